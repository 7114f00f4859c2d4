"""The shared sweep: for every dtype × redop × root, warm up, then for every size and placement
(out-of-place, in-place) time each implementation, check its results, and combine the ranks'
numbers. Ops contribute only what pynccl/bench/ops/*.py define; printing is the Reporter's.

As in nccl-tests: buffers of maxBytes are allocated once and each timed iteration uses the next
size-sized slice of them (so small sizes do not run from a warm cache), one untimed op precedes the
timed ones, and results are checked with fresh data after timing.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as tdist

from . import data
from .formatting import bandwidths
from .ops.base import CallSpec, Collective, Counts
from .options import DTYPES, size_steps
from .timing import GraphCapturer, device_sync, timed_loop, timed_replay

PLACEMENTS = (False, True)  # in_place: out-of-place first, as nccl-tests prints them


class OpFailed(RuntimeError):
    """The primary implementation cannot run this op here. Raised on every rank alike (the ranks
    agree on failures first), so the run can go on with the next op."""


@dataclass
class Cell:
    """One implementation × placement of one row, combined over ranks."""
    time_s: Optional[float] = None    # wall time per op (-a combined), None if it did not run
    cpu_s: Optional[float] = None     # host time to enqueue one op
    rep_times: List[float] = field(default_factory=list)  # this rank's per-repetition times
    rep_cpu: List[float] = field(default_factory=list)
    wrong: Optional[int] = None       # wrong elements over all ranks; None: not checked (N/A)
    error: Optional[str] = None
    algbw: Optional[float] = None
    busbw: Optional[float] = None


@dataclass
class Row:
    size: int
    count: int
    type_name: str
    redop: str
    root: int
    cells: Dict[Tuple[str, bool], Cell] = field(default_factory=dict)


@dataclass
class Context:
    rank: int
    nranks: int
    device: torch.device
    impls: list                 # primary first
    side_group: object          # gloo torch.distributed group for barriers and combining numbers
    opts: object

    def __post_init__(self):
        self.sync = device_sync(self.device)
        self.graphs = GraphCapturer(self.device) if self.opts.cudagraph else None
        self.disabled: Dict[str, str] = {}   # impl name -> why it stopped (secondary impls only)
        self.seed = 0

    def barrier(self):
        tdist.barrier(group=self.side_group)

    def all_reduce_side(self, values, op) -> list:
        t = torch.tensor(values, dtype=torch.float64)
        tdist.all_reduce(t, op=op, group=self.side_group)
        return t.tolist()

    def combine_times(self, values: List[float]) -> List[float]:
        """-a: 0 rank 0's, 1 mean, 2 min, 3 max over ranks."""
        mode = self.opts.average
        t = torch.tensor(values, dtype=torch.float64)
        if mode == 0:
            tdist.broadcast(t, src=0, group=self.side_group)  # the side group spans every rank
        else:
            op = {1: tdist.ReduceOp.SUM, 2: tdist.ReduceOp.MIN, 3: tdist.ReduceOp.MAX}[mode]
            tdist.all_reduce(t, op=op, group=self.side_group)
            if mode == 1:
                t /= self.nranks
        return t.tolist()

    def active_impls(self):
        return [i for i in self.impls if i.name not in self.disabled]


class Buffers:
    """Send and receive buffers of maxBytes, and the slices one size uses in iteration i."""

    def __init__(self, max_bytes: int, device: torch.device):
        self.max_bytes = max_bytes
        self.send = torch.empty(max_bytes, dtype=torch.uint8, device=device)
        self.recv = torch.empty(max_bytes, dtype=torch.uint8, device=device)

    def views(self, counts: Counts, dtype: torch.dtype, rank: int, in_place: bool, iteration: int):
        e = dtype.itemsize
        total = max(counts.send, counts.recv) * e
        steps = max(1, self.max_bytes // total) if total else 1
        shift = total * (iteration % steps)
        if in_place:
            send = self._region(self.recv, shift + rank * counts.send_inplace_offset * e, counts.send, dtype, e)
            recv = self._region(self.recv, shift + rank * counts.recv_inplace_offset * e, counts.recv, dtype, e)
        else:
            send = self._region(self.send, shift, counts.send, dtype, e)
            recv = self._region(self.recv, shift, counts.recv, dtype, e)
        return send, recv

    @staticmethod
    def _region(buf, offset, count, dtype, e):
        return buf[offset: offset + count * e].view(dtype)


def run_op(op: Collective, ctx: Context, reporter) -> None:
    """The whole test of one op, rows streamed to `reporter` (rank 0 prints)."""
    opts = ctx.opts
    ctx.reporter = reporter
    sizes = size_steps(opts)
    buffers = Buffers(max(opts.maxbytes, 16), ctx.device)
    redops = opts.redop if op.has_redop else [None]
    roots = ([r for r in range(ctx.nranks)] if opts.root == -1 else [opts.root]) if op.has_root else [-1]
    for root in roots:
        if not -1 <= root < ctx.nranks:
            raise ValueError(f"-r {root}: root must be a rank in [0, {ctx.nranks}) or -1 for all")
    many = len(opts.datatype) > 1 or len(redops) > 1
    for type_name in opts.datatype:
        dtype = DTYPES[type_name]
        for redop in redops:
            for root in roots:
                if not _warm_up(op, ctx, buffers, dtype, redop, root, sizes, reporter, skippable=many):
                    continue
                for size in sizes:
                    row = _measure_row(op, ctx, buffers, size, dtype, type_name, redop, root)
                    reporter.row(row)


def _spec(op, ctx, impl, counts, redop, root):
    return CallSpec(rank=ctx.rank, nranks=ctx.nranks, root=root, redop=impl.redop(redop), counts=counts)


def _counts(op, size, dtype, nranks) -> Counts:
    e = dtype.itemsize
    return op.counts(size // e, nranks, e)


def _warm_up(op, ctx, buffers, dtype, redop, root, sizes, reporter, skippable) -> bool:
    """nccl-tests' warm-up: -w out-of-place ops at the largest, then at the smallest size.
    Returns False (after saying why) when the primary implementation cannot run this dtype/redop
    and the run loops over several (-d all / -o all): that combination is skipped."""
    for size, iters in ((sizes[-1], ctx.opts.warmup_iters), (sizes[0], max(1, ctx.opts.warmup_iters))):
        # NOTE: at least one op even with -w 0: it finds out whether this dtype/redop runs at all
        # (each cell runs an untimed op first anyway, so timing is unaffected).
        counts = _counts(op, size, dtype, ctx.nranks)
        for impl in ctx.active_impls():
            primary = impl is ctx.impls[0]
            try:
                spec = _spec(op, ctx, impl, counts, redop, root)
                calls = [op.make_call(impl, *buffers.views(counts, dtype, ctx.rank, False, i), False, spec)
                         for i in range(iters)]
                for call in calls:
                    call()
                ctx.sync()
                failed = None
            except (ValueError, TypeError, RuntimeError) as e:
                failed = f"{type(e).__name__}: {e}"
            if _agree_on_failure(ctx, failed):
                what = f"{_type_label(dtype)} {redop or ''}".strip()
                msg = failed or "failed on another rank"
                if primary:
                    if not skippable:
                        raise OpFailed(f"{op.name} ({what}) cannot run with {impl.name}: {msg}")
                    reporter.note(f"skipping {op.name} {what}: {impl.name}: {msg}")
                    return False
                ctx.disabled[impl.name] = f"{op.name} {what}: {msg}"
                reporter.note(f"{impl.name} stopped: {ctx.disabled[impl.name]}")
    return True


def _type_label(dtype):
    return next(name for name, d in DTYPES.items() if d == dtype)


def _agree_on_failure(ctx, failed: Optional[str]) -> bool:
    """Every rank learns whether any rank failed, so that all take the same path afterwards."""
    return ctx.all_reduce_side([1.0 if failed else 0.0], tdist.ReduceOp.MAX)[0] > 0


def _measure_row(op, ctx, buffers, size, dtype, type_name, redop, root) -> Row:
    counts = _counts(op, size, dtype, ctx.nranks)
    e = dtype.itemsize
    row = Row(size=max(counts.send, counts.recv) * e, count=counts.param, type_name=type_name,
              redop=redop or "none", root=root)
    for in_place in PLACEMENTS:
        for impl in ctx.impls:
            row.cells[(impl.name, in_place)] = Cell()
        _measure_cell(op, ctx, buffers, row, counts, dtype, redop, root, in_place)
    _combine_row(op, ctx, row)
    return row


def _measure_cell(op, ctx, buffers, row, counts, dtype, redop, root, in_place):
    opts = ctx.opts
    n = opts.iters
    prepared = {}
    for impl in ctx.active_impls():
        cell = row.cells[(impl.name, in_place)]
        spec = _spec(op, ctx, impl, counts, redop, root)
        try:
            calls = [op.make_call(impl, *buffers.views(counts, dtype, ctx.rank, in_place, i), in_place, spec)
                     for i in range(n)]
            if opts.blocking:
                calls = [_blocking(call, ctx) for call in calls]
            _init_data(ctx, buffers, counts, dtype, redop, in_place)
            calls[0]()          # one untimed op, as nccl-tests' "Sync" iteration
            ctx.sync()
            graph = ctx.graphs.capture(calls) if ctx.graphs else None
            failed = None
        except (ValueError, TypeError, RuntimeError) as e:
            failed = f"{type(e).__name__}: {e}"
        if _agree_on_failure(ctx, failed):
            cell.error = failed or "failed on another rank"
            placement = "in-place" if in_place else "out-of-place"
            if impl is ctx.impls[0] and not (in_place and not op.in_place_checked):
                raise OpFailed(f"{op.name} {placement} ({row.type_name}, {row.size} B) failed with "
                                   f"{impl.name}: {cell.error}")
            if impl is not ctx.impls[0]:
                ctx.reporter.note(f"{impl.name} {placement} did not run (N/A): {cell.error}", once=True)
            continue
        prepared[impl.name] = (impl, calls, graph)

    order = list(prepared.values())
    for rep in range(opts.reps):
        # Alternate which implementation goes first, so neither always inherits the other's wake.
        for impl, calls, graph in (order if rep % 2 == 0 else order[::-1]):
            ctx.sync()
            ctx.barrier()
            if graph is not None:
                cpu, wall = timed_replay(graph, opts.cudagraph, ctx.sync)
                wall /= opts.cudagraph
            else:
                cpu, wall = timed_loop(calls, ctx.sync)
            cell = row.cells[(impl.name, in_place)]
            cell.rep_times.append(wall / n)
            cell.rep_cpu.append(cpu / n)
    for impl, calls, graph in order:
        cell = row.cells[(impl.name, in_place)]
        cell.time_s = statistics.median(cell.rep_times)
        cell.cpu_s = statistics.median(cell.rep_cpu)
        if opts.check and (op.in_place_checked or not in_place):
            cell.wrong = _check(op, ctx, buffers, counts, dtype, redop, root, in_place, calls[0])


def _blocking(call, ctx):
    sync, barrier, with_barrier = ctx.sync, ctx.barrier, ctx.opts.blocking == 1

    def blocking_call():
        call()
        sync()
        if with_barrier:
            barrier()
    return blocking_call


def _init_data(ctx, buffers, counts, dtype, redop, in_place):
    ctx.seed += 1
    send, recv = buffers.views(counts, dtype, ctx.rank, in_place, 0)
    data.fill_poison(recv)
    data.fill_input(send, ctx.rank, redop, ctx.nranks, ctx.seed)


def _check(op, ctx, buffers, counts, dtype, redop, root, in_place, call) -> int:
    """-c times: fresh data, one op (in a graph with -G), compare; this rank's wrong elements."""
    wrong = 0
    for _ in range(ctx.opts.check):
        _init_data(ctx, buffers, counts, dtype, redop, in_place)
        ctx.sync()
        ctx.barrier()
        if ctx.graphs is not None:
            graph = ctx.graphs.capture([call])
            graph.replay()
        else:
            call()
        ctx.sync()
        _, recv = buffers.views(counts, dtype, ctx.rank, in_place, 0)
        segments = op.expected(ctx.rank, ctx.nranks, root, counts)
        if ctx.opts.corrupt:
            data.corrupt(recv, segments)
        wrong = data.count_wrong(recv, segments, redop, ctx.nranks, ctx.seed)
        if ctx.all_reduce_side([float(wrong)], tdist.ReduceOp.SUM)[0]:
            break
    return wrong


def _combine_row(op, ctx, row: Row) -> None:
    """Every rank contributes its times and wrong counts; all ranks end with the combined row."""
    keys = sorted(row.cells, key=lambda k: (k[1], k[0]))
    times = [row.cells[k].time_s if row.cells[k].time_s is not None else 0.0 for k in keys]
    cpus = [row.cells[k].cpu_s if row.cells[k].cpu_s is not None else 0.0 for k in keys]
    combined = ctx.combine_times(times + cpus)
    wrongs = ctx.all_reduce_side([float(row.cells[k].wrong or 0) for k in keys], tdist.ReduceOp.SUM)
    factor = op.bus_factor(ctx.nranks)
    for i, k in enumerate(keys):
        cell = row.cells[k]
        if cell.time_s is None:
            continue
        cell.time_s, cell.cpu_s = combined[i], combined[len(keys) + i]
        if cell.wrong is not None:
            cell.wrong = int(wrongs[i])
        cell.algbw, cell.busbw = bandwidths(row.size, cell.time_s, factor)
