"""Issue 26, `DistributedDataParallel(..., tied_embedding_rows=None|True|False)` (on by default
where it applies; defaults.py): the tied embedding's gradient crosses the wire in two parts, the
LM head's early and the lookups' as the rows they touched.

In GPT-2 and nanoGPT the token embedding's weight is also the LM head's. Its gradient is the sum
of the head's part, dense (every vocabulary row) and complete at the very start of backward, and
the lookup's, non-zero only in the rows of this rank's tokens and complete at the very end.
Autograd sums the two before the weight's gradient hook fires, so torch DDP all-reduces 147 MiB
for GPT-2's 50257 x 768 fp32 weight after the last op of backward, with nothing left to hide it
(the exposed tail of benchmarks/RESULTS.md).

Here, inside DDP's own synced forward only, the head and the lookups read the weight through
aliases (an autograd Function returning weight.view_as(weight)); the lookups record their token
ids. In backward the head alias hands the head's part (plus whatever .grad held: no_sync
accumulation) to the reducer as the weight's gradient, which marks the weight ready, so its
bucket is all-reduced while the rest of backward runs; the lookup alias keeps the lookups'
gradient (torch's own embedding backward, dense). Both return nothing to the weight. Before the
tied bucket goes out every rank all-gathers how many distinct rows its lookups touched, read on
the host only at the end of backward (no stream waits for it). At the end each rank sends those
rows (padded to the largest count for the all-gather; on CUDA in place, through a buffer in an
NCCL symmetric window made at the first exchange, so the gather runs on the copy engines: session
14 measured 0.55 against 0.66 without it, 4xH100 GPT-2 medium), in `rows_chunks` (4) slices of
each rank's rows, and every rank adds all of them, times the reducer's 1/N, to the all-reduced head
part, slice by slice and rank by rank with index_add_, each slice's adds running while the next
slice is gathered (session 16, 4xH100 nanoGPT: 0.58 against 0.62 in one piece). A rank's ids are
distinct, so each add is deterministic, and every rank adds in the same order: the sum is the same
on every rank, the replicas stay equal. That becomes the weight's .grad. Where
N x the largest count exceeds the vocabulary (the gathered rows would outweigh the dense
gradient, on the wire and in memory) the lookups' gradient is all-reduced densely instead,
decided alike on every rank from the gathered counts.

Exact as torch DDP up to the fp32 rounding order of one sum (a + b reduced against a reduced
plus b reduced): a sum is linear, and a lookup's gradient is zero off the rows its ids name.
Nothing runs in forward but the aliases (no collective). A gradient that reaches the weight past
both aliases (a functional use of the weight elsewhere) is found in the first step (one host
sync), all-reduced there, and the path then steps aside for good; appearing only later, it
raises. Where the aliases leave the gradient to autograd (nothing diverted): torch.autograd.grad
(nothing accumulates, DDP reduces nothing, as torch's), backward(inputs=...) without the weight,
a second backward on one forward, a frozen weight. A loss that skips the head on some rank: the
weight goes out when its lookups' gradient arrives there. Several head calls in one step (two
forwards before one backward): the first head part goes out early, the later ones join the
lookups' gradient, which then crosses densely (each rank's head call count rides with its row
count). With find_unused_parameters or static_graph, a rank whose forward skipped the tied
modules still takes part in the gather and the exchange. With a built-in fp16 / bf16 compress
hook only the head part is compressed: the rows cross in fp32 (closer to the fp32 sum than
torch's compressed whole). torch's own forward runs under torch.compile, in
no_sync(), without grad, in a direct call of ddp.module and under saved-tensor hooks (activation
checkpointing around the head or the lookup: its gradient then reaches the weight past the
aliases, so the first step turns the path off); a deep copy or pickled module keeps nothing of
this path.

Where it applies: an nn.Linear with torch's own forward (the head) whose weight, a registered
parameter, is registered otherwise only by nn.Embedding modules with torch's own forward (not
sparse, no max_norm, no scale_grad_by_freq): a subclass's forward may look up other rows than
its ids name. Stepping aside (default) or refused (asked for with True): a comm hook other than
the built-in ones, overlap_optimizer, join(), a gradient hook on the tied weight (register_hook,
or a post-accumulate hook beside DDP's), a forward captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.reduce_op import ReduceOp
from ..comm.symmetric import alloc_symmetric


def _plain_lookup(emb: nn.Module) -> bool:
    return (isinstance(emb, nn.Embedding) and type(emb).forward is nn.Embedding.forward and emb.max_norm is None
            and not emb.sparse and not emb.scale_grad_by_freq)


def tied_heads(module: nn.Module) -> List[Tuple[nn.Linear, List[nn.Embedding]]]:
    """The (LM head, its embeddings) pairs of `module` that this path handles (module docstring)."""
    # NOTE: a parametrized weight (weight_norm, LoRA) is computed, not a registered parameter: left alone.
    owners: Dict[int, List[nn.Module]] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    found = []
    for m in module.modules():
        w = m._parameters.get("weight") if isinstance(m, nn.Linear) else None
        if w is None or type(m).forward is not nn.Linear.forward or not w.requires_grad:
            continue
        others = [o for o in owners[id(w)] if o is not m]
        # NOTE: every other owner must be torch's own lookup: the rows its ids name are the only ones
        # its gradient touches (a subclass's forward may look up other rows, or several times).
        if others and all(_plain_lookup(o) for o in others):
            found.append((m, others))
    return found


class _Alias(torch.autograd.Function):
    """weight.view_as(weight); backward offers the gradient to TiedEmbeddingRows.divert."""

    @staticmethod
    def forward(ctx, weight, rows, k, part):
        ctx.rows, ctx.k, ctx.part = rows, k, part
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        if ctx.rows.divert(ctx.k, ctx.part, grad):
            return None, None, None, None
        return grad, None, None, None


class _Forward:
    """A module's `forward` (an instance attribute) only while DDP's own synced forward runs
    (forward_window installs and removes it). Copied or pickled while installed, it becomes
    torch's own forward bound to the copy (functools.partial: loads without pynccl)."""

    def __init__(self, module: nn.Module, rows: "TiedEmbeddingRows", k: int):
        self.module, self.k = module, k
        self.torch_forward = type(module).forward
        self.rows = weakref.ref(rows)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:      # NOTE: torch's parameter name
        m = self.module
        # NOTE: is_compiling first: dynamo then traces torch's forward and nothing else here. Under
        # non-reentrant checkpointing the recompute in backward runs torch's forward: so does this.
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or _saved_tensor_hooks_active():
            return self.torch_forward(m, input)
        rows = self.rows()
        if rows is None or not rows.may_divert(self.k):
            return self.torch_forward(m, input)
        if isinstance(m, nn.Embedding):
            rows.record(self.k, input)
            return F.embedding(input, _Alias.apply(m.weight, rows, self.k, "lookup"), m.padding_idx)
        rows.steps[self.k].head_calls += 1
        return F.linear(input, _Alias.apply(m.weight, rows, self.k, "head"), m.bias)

    def __reduce__(self):
        return functools.partial, (self.torch_forward, self.module)


def _saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _accumulator(w: torch.Tensor):
    """The weight's AccumulateGrad node, as the running backward's graph holds it (autograd caches
    it weakly per tensor). NOTE: never kept between steps: a node kept alive keeps the stream it was
    made on, and autograd then makes the backward's stream wait for that one (under CUDA graph
    capture from a side stream: cudaErrorStreamCaptureImplicit, the legacy stream)."""
    with torch.enable_grad():
        return w.view_as(w).grad_fn.next_functions[0][0]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Step:
    """One tied weight's state between a synced forward and the end of its backward."""

    def __init__(self):
        self.ids: List[torch.Tensor] = []       # every lookup's token ids, flat
        self.head_calls = 0                     # more than one: a later head part joins the rest, dense
        self.rest: Optional[torch.Tensor] = None  # the lookups' gradient (and later head parts), diverted
        self.counts = None                      # (mask, counts (pinned on CUDA), event) once gathered


class TiedEmbeddingRows:
    """Installs the aliases on each handled head and its embeddings, diverts their gradients in
    backward (Reducer.mark_ready_with), gathers the row counts before the tied bucket goes out
    (before_bucket) and exchanges the rows at the end (Reducer._on_backward_end calls finish())."""

    def __init__(self, ddp, pairs: List[Tuple[nn.Linear, List[nn.Embedding]]], explicit: bool = True):
        if not pairs:
            raise ValueError("DistributedDataParallel: tied_embedding_rows=True but the module has no nn.Linear "
                             "(the LM head) whose weight only nn.Embedding modules with torch's own forward also "
                             "register; nothing to do")
        self.group = ddp.process_group
        self.backend = self.group.backend
        self.rank = int(ddp.process_group.group_rank)
        self.reducer = ddp.reducer
        self.explicit = explicit              # asked for outright: refuse what needs the plain path (defaults.py)
        self.heads = [h for h, _ in pairs]
        self.embeddings = [e for _, e in pairs]
        self.weights = [h.weight for h in self.heads]
        self.index = [self.reducer.bucketer._index_of[id(w)] for w in self.weights]
        self.steps: List[Optional[_Step]] = [None] * len(pairs)
        self.checked = False                  # the first exchange agreed that nothing else uses the weights
        self.last_exchange = None             # "rows", "dense" or "none": how the last lookups' gradient crossed
        self.side = torch.cuda.Stream(ddp.device) if ddp.device.type == "cuda" else None
        # NOTE: per weight, the rows' all-gather buffer in an NCCL symmetric window (made at the first
        # rows exchange, collectively; False where the group has none): the gather then runs on the
        # copy engines (or NCCL's symmetric kernels) instead of a ring kernel. Its vocabulary x width
        # values stay allocated while the path is on (counted by train_bench's peak, not by
        # torch.cuda.max_memory_allocated). Off (every rank alike: the choice is not agreed on):
        # ordinary buffers (benchmarks/ddp_bench_lib/levers.py's lever "rows-plain-buffers").
        self.rows_in_window = True
        # NOTE: the rows cross in this many slices of each rank's rows, each slice's index_add_s
        # running while the next slice is gathered (on 4xH100 the exchange took 0.63 ms at the end of
        # backward, session 16). Every rank alike (not agreed on): the slices are collectives.
        self.rows_chunks = 4
        self._windows: List[object] = [None] * len(pairs)
        # NOTE: made once: the same objects at every install, so a model compiled inside DDP (nanoGPT's
        # order) does not see a new `forward` each step (dynamo would recompile).
        self._forwards = [(m, _Forward(m, self, k)) for k, (h, es) in enumerate(pairs) for m in [h] + es]

    def _in_backward(self) -> bool:
        return bool(self.reducer.diverted) or self.reducer.bucketer.in_backward

    def remove(self) -> None:
        """Back to torch's path for good (a feature that needs the plain path, where the default
        turned this path on). Not while a backward runs; a forward whose backward comes later
        takes torch's path then (divert refuses once this object is not the reducer's)."""
        if self._in_backward():
            raise RuntimeError("DistributedDataParallel: cannot turn tied_embedding_rows off during a backward; do "
                               "it before the step")
        self.steps = [None] * len(self.steps)
        self._uninstall()
        # NOTE: the rows windows go to the reducer, which frees them at its next forward outside a
        # CUDA graph capture: the default steps aside when a capture begins, and freeing a window
        # (ncclMemFree) there would invalidate the capture.
        self.reducer.retired_windows.extend(w for w in self._windows if isinstance(w, torch.Tensor))
        self._windows = [False] * len(self._windows)
        self.reducer.tied_rows = None

    @contextlib.contextmanager
    def forward_window(self, sync: bool):
        """Around DDP's call of its module: the head and lookups read the alias only inside a synced one."""
        if sync:
            for m, forward in self._forwards:
                m.forward = forward
        try:
            yield
        finally:
            self._uninstall()

    def _uninstall(self) -> None:
        for m, _ in self._forwards:
            if isinstance(m.__dict__.get("forward"), _Forward):
                del m.forward

    # ------------------------------------------------------------------ forward
    def may_divert(self, k: int) -> bool:
        """In forward: whether weight k's users read the alias (False: torch's, having stepped aside)."""
        w = self.weights[k]
        if not w.requires_grad:
            return False                   # frozen (requires_grad_(False) after DDP was built): torch's path
        why = None
        if w._backward_hooks or len(getattr(w, "_post_accumulate_grad_hooks", None) or ()) > 1:
            why = ("the tied weight has a gradient hook (register_hook or a post-accumulate-grad hook of its own); "
                   "it would not see the head's and the lookups' parts. Remove the hook or the option")
        elif _capturing():
            why = ("a CUDA graph is being captured, and the exchange reads the row counts on the host. Pass "
                   "tied_embedding_rows=False for a captured step")
        if why is None:
            if self.steps[k] is None:
                self.steps[k] = _Step()
            return True
        if not self.explicit and not self._in_backward():                # the default: step aside
            self.remove()
            return False
        asked = "tied_embedding_rows=True" if self.explicit else "tied_embedding_rows"
        raise RuntimeError(f"DistributedDataParallel({asked}): {why}")

    def record(self, k: int, ids: torch.Tensor) -> None:
        self.steps[k].ids.append(ids.reshape(-1))

    # ------------------------------------------------------------------ backward
    def divert(self, k: int, part: str, grad: torch.Tensor) -> bool:
        """In backward, with the head's part or a lookup's: take it (True) or leave it to autograd."""
        reducer, idx, step = self.reducer, self.index[k], self.steps[k]
        if step is None or reducer.tied_rows is not self or not reducer.bucketer.armed:
            return False
        try:
            if not torch._C._will_engine_execute_node(_accumulator(self.weights[k])):
                return False               # backward(inputs=...) without the weight
        except RuntimeError:
            return False                   # torch.autograd.grad: nothing accumulates, nothing to reduce
        if idx not in reducer.diverted and reducer.bucketer.got_gradient(idx):
            # NOTE: the weight's own gradient hook already fired in this backward (a use that bypassed the
            # aliases ran in a reentrant checkpoint's backward, which ends first): this part goes to
            # .grad as well, as autograd would (static_graph counts the second firing; without it the
            # bucketer refuses a parameter ready twice)
            return False
        if part == "lookup" or idx in reducer.diverted:
            # NOTE: a head part after the weight went out (a second head call: head_calls > 1, so
            # the rest crosses densely) joins the lookups' gradient.
            step.rest = grad if step.rest is None else step.rest.add_(grad)
            if idx in reducer.diverted:
                return True
            grad = None                    # the head's part never came (this loss skips the head): out now
        w = self.weights[k]
        held = w.grad
        with torch.no_grad():
            if held is not None:
                # NOTE: what .grad holds (no_sync accumulation, zeros kept by zero_grad(set_to_none=False))
                # goes with the head's part, added in place as AccumulateGrad would.
                source = held.add_(grad) if grad is not None else held
                w.grad = None
            elif grad is None:
                source = torch.zeros_like(w)
            else:
                source = grad if grad.is_contiguous() else grad.contiguous()
            reducer.mark_ready_with(idx, source)
        return True

    @torch.no_grad()
    def before_bucket(self, b) -> None:
        """Before bucket b's reduction goes out (every rank, in bucket order): for each tied weight
        in it, all-gather how many rows its lookups touched; read on the host at the end of backward
        (on CUDA through pinned memory behind an event on a side stream: no stream waits for it, and
        the host only if the collective has not ended by then)."""
        bucket_of = self.reducer.bucketer._bucket_of
        for k, i in enumerate(self.index):       # NOTE: the tied weights (one, usually), not the bucket's params
            if bucket_of[i] != b.index:
                continue
            step = self.steps[k]
            if step is None:
                if not (self.reducer.find_unused or self.reducer.static_graph):
                    continue
                # NOTE: a rank whose forward skipped the tied modules (find_unused_parameters is for
                # that) still takes part in the gather and the exchange, with nothing of its own.
                step = self.steps[k] = _Step()
            w = self.weights[k]
            mask = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
            if step.ids:
                # NOTE: index_fill_ takes the value as a kernel argument; `mask[ids] = True` copies it
                # from pageable memory, which synchronizes the stream (12 ms a step on 2xH100 nanoGPT).
                mask.index_fill_(0, torch.cat(step.ids).long(), True)      # F.embedding takes int32 ids too
            # NOTE: (distinct rows, whether the rest must cross densely: a second head call)
            # (torch.full passes the flag as a kernel argument: no host-to-device copy, no stream sync)
            mine = torch.stack([mask.sum(), torch.full((), int(step.head_calls > 1), dtype=torch.int64,
                                                       device=w.device)])
            counts = torch.empty(2 * self.backend.world_size, dtype=torch.int64, device=w.device)
            work = self.backend.all_gather_into_tensor(counts, mine, async_op=True)
            ready = None
            if self.side is not None:
                self.side.wait_stream(torch.cuda.current_stream(w.device))
                with torch.cuda.stream(self.side):
                    work.wait()
                    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
                    host.copy_(counts, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record()
                step.counts = (mask, host, ready, counts, mine)   # the device tensors: alive until read
            else:
                work.wait()
                step.counts = (mask, counts, None)

    @torch.no_grad()
    def finish(self, scale: float, reduced_of) -> None:
        """For each tied weight: every rank's lookup rows, times `scale`, added into its all-reduced
        head part, which becomes its .grad. `reduced_of(idx)`: where a diverted weight's all-reduced
        part lies (None: nothing diverted here; .grad already holds the all-reduced gradient).
        NOTE: one exchange per weight whose users ran in this step, in order: the same collectives on every rank."""
        steps, self.steps = self.steps, [None] * len(self.steps)
        disable, checked = False, self.checked
        for k, step in enumerate(steps):
            if step is None or step.counts is None:
                continue
            w, idx = self.weights[k], self.index[k]
            mask, host, ready = step.counts[:3]
            if ready is not None:
                ready.synchronize()
            gathered = host.tolist()
            counts, dense = gathered[0::2], any(gathered[1::2])
            held = reduced_of(idx)
            stray = None
            if held is None:
                held = w.grad
            else:
                stray = w.grad           # what reached the weight past both aliases
            if held is None:
                if max(counts) == 0 and not dense:
                    self.last_exchange = "none"
                    continue             # no gradient anywhere: .grad stays None, as torch's
                held = torch.zeros_like(w)
            w.grad = held
            self._exchange(k, step, mask, counts, held, scale, dense)
            if not checked:
                disable = self._first_check(w, stray, held, scale) or disable
            elif stray is not None:
                raise RuntimeError("DistributedDataParallel(tied_embedding_rows): the tied weight got a gradient "
                                   "from outside its head and its embeddings' lookups in this step, which this "
                                   "path does not reduce (it did not in the first step). Pass "
                                   "tied_embedding_rows=False")
        self.checked = True
        if disable:
            self.remove()

    def _rows_window(self, k: int) -> Optional[torch.Tensor]:
        """Weight k's (world x vocabulary / world, width) rows buffer in a symmetric window, made at
        its first exchange (every rank exchanges then: a collective), or None (off, not CUDA, or
        the group has no windows: decided alike on every rank)."""
        if not self.rows_in_window or self.reducer.comm_path.name == "default":
            return None                    # NOTE: comm_path="default" asked for ordinary buffers
        if self._windows[k] is None:
            w, world = self.weights[k], self.backend.world_size
            cap = w.shape[0] // world        # the most rows a rank sends: more cross densely
            bufs = alloc_symmetric(self.group, [(world * cap * w.shape[1], w.dtype)])   # None without NCCL windows
            self._windows[k] = bufs[0].view(world * cap, w.shape[1]) if bufs else False
        window = self._windows[k]
        return window if isinstance(window, torch.Tensor) else None

    def _first_check(self, w: torch.Tensor, stray: Optional[torch.Tensor], held: torch.Tensor, scale: float) -> bool:
        """Once (a host sync): does any rank's weight get a gradient from another user (a functional
        use of the weight)? Then it is all-reduced here, and the path steps aside for good."""
        flags = torch.empty(self.backend.world_size, dtype=torch.int32, device=w.device)
        mine = torch.full((1,), int(stray is not None), dtype=torch.int32, device=w.device)
        self.backend.all_gather_into_tensor(flags, mine, async_op=True).wait()
        if not any(flags.tolist()):
            return False
        dense = stray if stray is not None else torch.zeros_like(w)
        self.backend.all_reduce(dense, ReduceOp.SUM)
        held.add_(dense, alpha=scale)
        return True

    def _exchange(self, k: int, step: _Step, mask: torch.Tensor, counts: List[int], held: torch.Tensor,
                  scale: float, dense: bool) -> None:
        width = max(counts)
        if width == 0 and not dense:
            self.last_exchange = "none"
            return
        w, rest = self.weights[k], step.rest
        if dense or len(counts) * width > w.shape[0]:
            # NOTE: every rank's rows would outweigh the dense gradient: all-reduce the lookups' densely.
            dense = rest if rest is not None else torch.zeros_like(w)
            self.backend.all_reduce(dense, ReduceOp.SUM)
            held.add_(dense, alpha=scale)
            self.last_exchange = "dense"
            return
        # NOTE: each rank's rows padded to `width` for the all-gather (the padding is never added).
        ids = torch.nonzero_static(mask, size=width, fill_value=0).reshape(-1)
        world = self.backend.world_size
        all_ids = ids.new_empty(world * width)
        id_work = self.backend.all_gather_into_tensor(all_ids, ids, async_op=True)
        # NOTE: the rows cross in `chunks` slices of `step` rows per rank, each slice gathered into
        # its own (world, step, dim) block, so slice c's index_add_s overlap slice c + 1's gather.
        # The blocks must fit the window (vocabulary / world rows per rank); else one slice.
        chunks = max(1, min(self.rows_chunks, width))
        step = -(-width // chunks)
        window = self._rows_window(k)
        if window is not None and step * chunks > window.shape[0] // world:
            chunks, step = 1, width
        dim = w.shape[1]
        if window is not None:           # in place: this rank's rows written straight into its slots
            blocks = window[: chunks * world * step].view(chunks, world, step, dim)
        else:
            blocks = w.new_empty(chunks, world, step, dim)
        works = []
        for c in range(chunks):
            lo, hi = c * step, min(width, (c + 1) * step)
            mine = blocks[c, self.rank]
            if rest is not None:
                torch.index_select(rest, 0, ids[lo:hi], out=mine[: hi - lo])
            else:
                mine[: hi - lo].zero_()  # (a slot past hi - lo, in the last slice, is never added)
            works.append(self.backend.all_gather_into_tensor(blocks[c].view(world * step, dim), mine, async_op=True))
        id_work.wait()
        # NOTE: slice by slice, then rank by rank, in rank order: within a rank's rows the ids are
        # distinct (padding adds zeros to row 0), so each index_add_ is deterministic, and every
        # rank adds the same rows in the same order (the replicas stay equal).
        for c, work in enumerate(works):
            work.wait()
            lo = c * step
            for r in range(world):
                hi = min(counts[r], lo + step)
                if hi > lo:
                    held.index_add_(0, all_ids[r * width + lo: r * width + hi], blocks[c, r, : hi - lo], alpha=scale)
        self.last_exchange = "rows"
