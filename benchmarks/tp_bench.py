"""Tensor-parallel transformer block, forward + backward: time against the unsharded block, and
how much of it is communication.

    python benchmarks/tp_bench.py                        # one GPU: TP=1, the cost of the TP machinery
    python benchmarks/tp_bench.py --nproc 8              # TP=8, one process per GPU (spawned)
    torchrun --nproc-per-node 8 benchmarks/tp_bench.py   # the same under torchrun
    python benchmarks/tp_bench.py --backend gloo --nproc 2 --hidden 64 --heads 4 --seq 32 --batch 2   # CPU smoke run

Default sizes: GPT-2 medium's block (hidden 1024, 16 heads, ffn 4096), seq 1024, batch 8, bf16.

Variants: `reference` (TransformerBlock, the whole block on every GPU), `tp` and `tp+sp`
(ParallelTransformerBlock over all ranks, without / with sequence parallelism). Columns:
  time       median over --reps of the mean fwd+bwd iteration (CUDA events around --iters
             iterations after --warmup), min-max spread; max over ranks
  speedup    reference time / this time (ideal: TP size)
  comm       time inside the collectives, from CUDA events recorded around every call the TP layers
             make, in a separate pass where each runs synchronously on the compute stream (so
             the events bracket it, and cannot slow the timed pass); calls: collectives per iteration
  no-comm    the same iteration with every collective replaced by a no-op returning tensors of
             the right shape: the compute alone. exposed = time - no-comm is what the iteration
             waits for communication; comm - exposed is what overlap hides (the column-parallel
             backward runs its collectives async, beside the weight-grad GEMM)
  peak       peak memory allocated by the iteration beyond what was allocated before it (activations,
             grads, workspaces; sequence parallelism shrinks the activations)
Interception swaps the `dist` module that pynccl.tensor_parallel.comm calls, so the layers
themselves run unchanged.
"""
import argparse
import contextlib
import json
import os
import statistics
import time

import torch

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.tensor_parallel import comm as tp_comm
from pynccl.testing import run_multiprocess
from pynccl.testing.reference_models import TransformerBlock

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class _Timer:
    """CUDA events on GPU, wall clock after the op on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, start, end):
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


class _Intercept:
    """Stands in for pynccl.comm.distributed inside tensor_parallel.comm: timed or no-op collectives."""

    def __init__(self, mode, timer):
        self.mode, self.timer, self.pairs = mode, timer, []

    def __getattr__(self, name):
        real = getattr(pynccl.comm.distributed, name)
        if name not in _COLLECTIVES:
            return real

        def call(*args, async_op=False, **kwargs):
            if self.mode == "timed":
                # Run on the compute stream, between two events, even where the layer asked for
                # async: the events then bracket the collective itself.
                start = self.timer.mark()
                real(*args, **kwargs)
                self.pairs.append((start, self.timer.mark()))
            # "none": outputs keep whatever torch.empty left there; the compute costs the same.
            return _DoneWork() if async_op else None
        return call


class _DoneWork:
    def wait(self, timeout=None):
        return True


@contextlib.contextmanager
def _collectives(mode, timer):
    if mode == "real":
        yield None
        return
    saved = tp_comm.dist
    tp_comm.dist = _Intercept(mode, timer)
    try:
        yield tp_comm.dist
    finally:
        tp_comm.dist = saved


def _time_iters(step, timer, a):
    for _ in range(a.warmup):
        step()
    timer.sync()
    reps = []
    for _ in range(a.reps):
        pynccl.barrier()
        start = timer.mark()
        for _ in range(a.iters):
            step()
        reps.append(timer.ms(start, timer.mark()) / a.iters)
    return reps


def _variant(model, x, dy, timer, a, with_comm_stats):
    def step():
        model.zero_grad(set_to_none=True)
        model(x).backward(dy)

    if timer.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    reps = _time_iters(step, timer, a)
    row = {"time_ms": statistics.median(reps), "min_ms": min(reps), "max_ms": max(reps)}
    row["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20 if timer.cuda else float("nan")
    if with_comm_stats:
        with _collectives("timed", timer) as spy:
            step()
            timer.sync()
            spy.pairs.clear()
            for _ in range(a.iters):
                step()
            timer.sync()
            row["comm_ms"] = sum(timer.ms(s, e) for s, e in spy.pairs) / a.iters
            row["calls"] = len(spy.pairs) // a.iters
        with _collectives("none", timer):
            row["no_comm_ms"] = statistics.median(_time_iters(step, timer, a))
    return row


def case(rank, world_size, a):
    group = pynccl.get_default_group()
    dev = pynccl.get_device(group)
    dtype = _DTYPES[a.dtype if dev.type == "cuda" else "fp32"]
    timer = _Timer(dev)
    torch.manual_seed(0)
    ref = TransformerBlock(a.hidden, a.heads, a.ffn, device=dev, dtype=dtype)
    x = torch.randn(a.seq, a.batch, a.hidden, device=dev, dtype=dtype)
    dy = torch.randn_like(x)
    rows = {"reference": _variant(ref, x.clone().requires_grad_(), dy, timer, a, False)}
    for sp in (False, True):
        model = tp.ParallelTransformerBlock.from_module(ref, group, sequence_parallel=sp)
        xs, dys = (x.chunk(world_size)[rank], dy.chunk(world_size)[rank]) if sp else (x, dy)
        rows["tp+sp" if sp else "tp"] = _variant(model, xs.clone().requires_grad_(), dys.contiguous(), timer, a, True)
        del model
    return rows


def _fmt(v, spec):
    return "-" if v is None or v != v else format(v, spec)


def report(results, a, world_size, backend):
    dev_name = torch.cuda.get_device_name() if backend == "nccl" else "cpu"
    print(f"# tp_bench: block fwd+bwd, hidden={a.hidden} heads={a.heads} ffn={a.ffn} seq={a.seq} batch={a.batch} "
          f"{a.dtype if backend == 'nccl' else 'fp32'}")
    print(f"# TP={world_size} on {world_size}× {dev_name}, backend={backend}, torch={torch.__version__}, "
          f"nccl={pynccl.nccl_version() if backend == 'nccl' else '-'}; time = max over ranks of the median of "
          f"{a.reps} reps × {a.iters} iters")
    ref_ms = max(r["reference"]["time_ms"] for r in results)
    print(f"{'variant':<10} {'time_ms':>9} {'spread':>15} {'speedup':>8} {'comm_ms':>8} {'calls':>6} {'comm%':>6} "
          f"{'no_comm_ms':>10} {'exposed_ms':>10} {'peak_MiB':>9}")
    summary = {}
    for name in results[0]:
        rows = [r[name] for r in results]
        t = max(r["time_ms"] for r in rows)
        lo, hi = min(r["min_ms"] for r in rows), max(r["max_ms"] for r in rows)
        has_comm = "comm_ms" in rows[0]
        comm = max(r["comm_ms"] for r in rows) if has_comm else None
        no_comm = max(r["no_comm_ms"] for r in rows) if has_comm else None
        share = None if comm is None else 100 * comm / t
        exposed = None if no_comm is None else t - no_comm
        peak = max(r["peak_mib"] for r in rows)
        print(f"{name:<10} {t:9.3f} {lo:7.3f}-{hi:<7.3f} {ref_ms / t:8.2f} {_fmt(comm, '8.3f'):>8} "
              f"{_fmt(rows[0].get('calls'), 'd'):>6} {_fmt(share, '6.1f'):>6} {_fmt(no_comm, '10.3f'):>10} "
              f"{_fmt(exposed, '10.3f'):>10} {_fmt(peak, '9.0f'):>9}")
        summary[name] = {"time_ms": t, "min_ms": lo, "max_ms": hi, "speedup": ref_ms / t, "comm_ms": comm,
                         "no_comm_ms": no_comm, "peak_mib": peak}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "tp_size": world_size, "device": dev_name, "results": summary}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--nproc", type=int, default=0, help="spawn this many ranks (default: torchrun's, else 1)")
    p.add_argument("--hidden", type=int, default=1024, help="GPT-2 medium; 16 heads split by TP = 1, 2, 4, 8, 16")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None, help="default 4 × hidden")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="on GPU; CPU runs use fp32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the summary here")
    a = p.parse_args()
    a.ffn = a.ffn or 4 * a.hidden
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if a.nproc and torchrun:
        p.error("--nproc spawns ranks itself; do not combine it with torchrun")
    if torchrun:
        pynccl.init_process_group(backend=a.backend)
        out = [None] * pynccl.get_world_size()
        pynccl.all_gather_object(out, case(pynccl.get_rank(), pynccl.get_world_size(), a))
        if pynccl.get_rank() == 0:
            report(out, a, len(out), a.backend)
        pynccl.destroy_process_group()
        return
    nproc = a.nproc or 1
    start = "spawn" if a.backend == "nccl" else None
    out = run_multiprocess(case, nproc, backend=a.backend, timeout=3600, args=(a,), start_method=start)
    report(out, a, nproc, a.backend)


if __name__ == "__main__":
    main()
