"""Issue 26, opt-in `DistributedDataParallel(..., tied_embedding_rows=True)` (or
PYNCCL_DDP_TIED_EMBEDDING_ROWS=1; defaults.py says why not a default): the lookup part of a tied embedding's gradient crosses the wire as the rows this
rank's tokens touched.

In GPT-2 and nanoGPT the token embedding's weight is also the LM head's. Its gradient is the sum
of two parts: the head's, dense (every vocabulary row) and complete at the very start of
backward, and the lookup's, non-zero only in the rows of this rank's tokens and complete at the
very end. Autograd sums the two before the weight's gradient hook fires, so DDP (torch's and
pynccl's default) all-reduces 147 MiB for GPT-2's 50257 × 768 fp32 weight after the last op of
backward, with nothing left to hide it (the exposed tail of benchmarks/RESULTS.md).

Here the two parts are reduced apart (a sum is linear; only the fp32 rounding order differs):
* the lookup reads the weight detached, so the weight's hook fires once the head's part is in,
  and its bucket is all-reduced while the rest of backward runs;
* the lookup's backward keeps (token ids, output-gradient rows) instead of returning a gradient;
* at the end of backward, after the buckets are written back, every rank's rows are all-gathered
  (B·T rows instead of V: nanoGPT's 12 × 1024 against 50257, 4× fewer bytes at 2 ranks) and
  added, times the reducer's scale (1/N), with index_put_(accumulate=True): on CUDA a sorted,
  deterministic sum, the same on every rank, so the replicas stay equal.

Ranks may feed different numbers of tokens: each lookup's count is all-gathered in forward (a
few bytes; on CUDA copied to pinned memory behind an event, read at the end of backward: the host
waits there only if it ran a whole step ahead of the GPU) and the rows are padded to the largest.
Every rank must make the same number of lookups per step, as with any collective. Each rank
receives (N - 1) x tokens x width values against the all-reduce's 2(N - 1)/N x vocabulary x width;
where N x the largest count exceeds the vocabulary (the gathered rows would outweigh the dense
gradient, on the wire and in memory), that lookup's dense gradient is all-reduced at the end
instead, as torch's tail, decided alike on every rank from the all-gathered counts.

Where it applies: an nn.Embedding with torch's own forward (no subclass forward, no max_norm, not sparse, no scale_grad_by_freq, its weight a
registered parameter) whose weight is also registered by a module that is not such an embedding
(the head). An untied embedding keeps the default path (its weight would get no gradient through
autograd at all). The replaced forward is installed only while DDP's own synced forward runs:
torch's lookup runs under torch.compile, in no_sync(), without grad, in a direct call of
ddp.module, and a deep copy or pickled module keeps nothing of this path. Refused where asked for
outright (turned off where the environment asked): a comm hook other than the built-in ones,
overlap_optimizer (it would step the weight before the rows arrive), join(), a gradient hook on
the tied weight, a forward captured in a CUDA graph. Refused always: a second backward through a
lookup, ids modified in place before the end of backward. Not covered (documented in
docs/training.md): torch.autograd.grad or backward(inputs=...) of the tied weight (the head's part
only), a step whose loss skips the head (needs find_unused_parameters=True). Activation
checkpointing around the lookup (saved-tensor hooks active) takes torch's lookup, as its recompute
in backward does.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm.reduce_op import ReduceOp


def tied_embeddings(module: nn.Module) -> List[nn.Embedding]:
    """The embeddings of `module` that this path handles (see the module docstring)."""
    # NOTE: a parametrized weight (weight_norm, LoRA) is computed, not a registered parameter: left alone.
    # NOTE: only torch's own lookup: a subclass with a forward of its own (HF Gemma's scaled embedding) is
    # left alone, since the rows path computes F.embedding.
    candidates = [m for m in module.modules() if isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward
                  and m.max_norm is None
                  and not m.sparse and not m.scale_grad_by_freq and m._parameters.get("weight") is not None
                  and m._parameters["weight"].requires_grad]
    handled = {id(m) for m in candidates}
    owners = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    return [m for m in candidates if any(id(o) not in handled for o in owners.get(id(m._parameters["weight"]), []))]


class _RowsLookup(torch.autograd.Function):
    """F.embedding on the detached weight; backward hands (ids, rows) to the exchange. `anchor` is a
    0-d leaf that makes the output require grad (the weight, detached, does not)."""

    @staticmethod
    def forward(ctx, ids, weight, anchor, padding_idx, lookup):
        ctx.lookup = lookup
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        if ctx.lookup.rows is not None or ctx.lookup.exchanged:
            raise RuntimeError("DistributedDataParallel(tied_embedding_rows=True): a second backward through the same "
                               "embedding lookup (retain_graph=True) is not supported: its rows would be lost")
        ctx.lookup.rows = grad
        return None, None, None, None, None


class _RowsForward:
    """An embedding's `forward` (an instance attribute) only while DDP's own synced forward runs
    (forward_window installs and removes it): outside it, in a direct call of ddp.module, a deep
    copy or a pickled module, the embedding is torch's. Copied or pickled while installed, it
    becomes torch's own forward bound to the copy (functools.partial: loads without pynccl)."""

    def __init__(self, emb: nn.Embedding, rows: "TiedEmbeddingRows"):
        self.emb = emb
        self.rows = weakref.ref(rows)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:      # NOTE: nn.Embedding.forward's parameter name
        emb = self.emb
        # NOTE: is_compiling first: dynamo then traces torch's lookup and nothing else here.
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return F.embedding(input, emb.weight, emb.padding_idx)
        if _saved_tensor_hooks_active():
            # NOTE: non-reentrant activation checkpointing (or offloading) around the lookup: its recompute
            # runs in backward, outside DDP's forward, with torch's lookup, so the forward must match it.
            return F.embedding(input, emb.weight, emb.padding_idx)
        rows = self.rows()
        if rows is None:
            return F.embedding(input, emb.weight, emb.padding_idx)
        return rows._lookup(emb, input)

    def __reduce__(self):
        return functools.partial, (nn.Embedding.forward, self.emb)


def _saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Lookup:
    """One call: the weight, its token ids (flat), the all-gathered counts, and after backward the
    output-gradient rows (None if its output never reached a loss: a forward with no backward,
    whose lookups go with the next backward's, as zeros, so every rank exchanges the same)."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, padding_idx: Optional[int], counts, ready):
        self.weight, self.ids, self.padding_idx, self.counts, self.ready = weight, ids, padding_idx, counts, ready
        self.ids_version = ids._version      # the ids are read at the end of backward: refilled in place is an error
        self.rows: Optional[torch.Tensor] = None
        self.exchanged = False

    def host_counts(self) -> List[int]:
        if self.ready is not None:
            # NOTE: recorded in forward; the host waits here only if it ran a whole step ahead of the GPU.
            self.ready.synchronize()
        return [int(c) for c in self.counts.tolist()]


class TiedEmbeddingRows:
    """Installs the lookup on each handled embedding, and adds the exchanged rows at the end of
    backward (Reducer._on_backward_end calls finish())."""

    def __init__(self, ddp, embeddings: List[nn.Embedding], explicit: bool = True):
        if not embeddings:
            raise ValueError("DistributedDataParallel: tied_embedding_rows=True but the module has no nn.Embedding "
                             "whose weight another module (the LM head) also registers; nothing to do")
        self.backend = ddp.process_group.backend
        self.reducer = ddp.reducer
        self.explicit = explicit              # asked for outright: refuse what needs the plain path (defaults.py)
        self.embeddings = embeddings
        self.lookups: List[_Lookup] = []
        self.anchor = torch.zeros((), device=ddp.device, requires_grad=True)
        self.last_exchange = None             # "rows" or "dense": how the last lookup's gradient crossed
        # NOTE: made once: the same objects at every install, so a model compiled inside DDP (nanoGPT's
        # order) does not see a new `forward` each step (dynamo would recompile).
        self._forwards = [_RowsForward(emb, self) for emb in embeddings]

    def remove(self) -> None:
        """Back to torch's lookup for good (a feature that needs the plain path, where the environment
        variable turned this path on). Only between steps: no lookup of this one may still wait for its rows."""
        if self.lookups:
            raise RuntimeError("DistributedDataParallel: cannot turn tied_embedding_rows off between a forward and "
                               "its backward; do it before the step")
        self._uninstall()
        self.reducer.tied_rows = None

    @contextlib.contextmanager
    def forward_window(self, sync: bool):
        """Around DDP's call of its module: lookups take the rows path only inside a synced one
        (a direct call of ddp.module reduces nothing and looks up as torch does)."""
        if sync:
            for emb, forward in zip(self.embeddings, self._forwards):
                emb.forward = forward
        try:
            yield
        finally:
            self._uninstall()

    def _uninstall(self) -> None:
        for emb in self.embeddings:
            if isinstance(emb.__dict__.get("forward"), _RowsForward):
                del emb.forward

    def _lookup(self, emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        why = None
        if emb.weight._backward_hooks:
            why = ("the tied weight has a gradient hook (register_hook); it would see the head's part only. Remove the "
                   "hook or the option")
        elif _capturing():
            why = ("a CUDA graph is being captured, and the exchange reads the token counts on the host. Pass "
                   "tied_embedding_rows=False for a captured step")
        if why is not None:
            if not self.explicit and not self.lookups:       # turned on by the environment: step aside
                self.remove()
                return F.embedding(ids, emb.weight, emb.padding_idx)
            raise RuntimeError(f"DistributedDataParallel(tied_embedding_rows=True): {why}")
        counts = torch.empty(self.backend.world_size, dtype=torch.int64, device=ids.device)
        mine = torch.full((1,), ids.numel(), dtype=torch.int64, device=ids.device)
        self.backend.all_gather_into_tensor(counts, mine, async_op=True).wait()   # a stream wait on CUDA
        ready = None
        if counts.is_cuda:
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            counts = host
        lookup = _Lookup(emb.weight, ids.reshape(-1), emb.padding_idx, counts, ready)
        self.lookups.append(lookup)
        return _RowsLookup.apply(ids, emb.weight.detach(), self.anchor, emb.padding_idx, lookup)

    @torch.no_grad()
    def finish(self, scale: float) -> None:
        """Adds every rank's lookup rows, times `scale`, into the tied weights' reduced gradients.
        NOTE: one exchange per lookup, in forward order: the same collectives on every rank."""
        lookups, self.lookups = self.lookups, []
        for lk in lookups:
            if lk.ids._version != lk.ids_version:
                raise RuntimeError("DistributedDataParallel(tied_embedding_rows=True): the token ids given to the "
                                   "embedding were modified in place before the end of backward")
        for lk in lookups:
            lk.exchanged = True
            grad = lk.weight.grad
            if grad is None:
                grad = lk.weight.grad = torch.zeros_like(lk.weight)
            counts = lk.host_counts()
            rows = self._local_rows(lk)
            if len(counts) * max(counts) > lk.weight.shape[0]:
                # NOTE: every rank's rows would outweigh the dense gradient (more bytes on the wire and
                # in memory): all-reduce the lookup's dense gradient instead, torch's tail. Every rank
                # decides alike (the counts are all-gathered).
                dense = torch.zeros_like(grad)
                dense.index_put_((lk.ids,), rows.to(grad.dtype), accumulate=True)
                self.backend.all_reduce(dense, ReduceOp.SUM)
                grad.add_(dense, alpha=scale)
                self.last_exchange = "dense"
                continue
            ids, rows = self._exchange(lk, counts, rows)
            grad.index_put_((ids,), rows.to(grad.dtype).mul_(scale), accumulate=True)
            self.last_exchange = "rows"

    @staticmethod
    def _local_rows(lk: _Lookup) -> torch.Tensor:
        """This rank's output-gradient rows, one per id (zeros for the padding row's)."""
        n = lk.ids.numel()
        if lk.rows is None:                   # the lookup's output did not reach this loss: no gradient
            rows = lk.weight.new_zeros(n, lk.weight.shape[1])
        else:
            rows = lk.rows.reshape(n, lk.weight.shape[1])
        if lk.padding_idx is not None:        # F.embedding's backward gives the padding row nothing
            rows = rows.masked_fill((lk.ids == lk.padding_idx).unsqueeze(-1), 0)
        return rows

    def _exchange(self, lk: _Lookup, counts: List[int], rows: torch.Tensor):
        """(every rank's ids, every rank's rows), each rank's padded to the largest count with id 0
        and zero rows (adding 0 changes nothing)."""
        width, n = max(counts), lk.ids.numel()
        ids = lk.ids
        if width != n:
            ids = torch.cat([ids, ids.new_zeros(width - n)])
            rows = torch.cat([rows, rows.new_zeros(width - n, rows.shape[1])])
        world = self.backend.world_size
        all_ids = ids.new_empty(world * width)
        all_rows = rows.new_empty(world * width, rows.shape[1])
        works = [self.backend.all_gather_into_tensor(all_ids, ids.contiguous(), async_op=True),
                 self.backend.all_gather_into_tensor(all_rows, rows.contiguous(), async_op=True)]
        for w in works:
            w.wait()
        return all_ids, all_rows
