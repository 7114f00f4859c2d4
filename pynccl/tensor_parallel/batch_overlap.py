"""A block's tensor-parallel collectives overlapped with its own compute on other batch chunks
(issue 27, asynchronous tensor parallelism, eager mode).

Without sequence parallelism an attention or MLP block costs one all-reduce forward (its
row-parallel output, o_proj / down_proj) and one backward (its input's gradient, summed once for
q, k and v or gate and up by PrepareModuleInput). Each waits on the block before it and blocks
the block after it: nothing runs beside them. Here the block runs once per chunk of the batch
(dim 0) and each chunk's collectives run beside the next chunk's compute:

    forward:  chunk 0 | chunk 1 | ... | chunk k-1 ; wait, concatenate
                       AR(out 0) | AR(out 1) ...        (a row-parallel output's all-reduce, deferred)
    backward: chunk k-1 | chunk k-2 | ... | chunk 0 ; wait, concatenate
                         AR(dX k-1) | AR(dX k-2) ...    (the block input's gradient, started per chunk)

Only the last chunk's collectives are left with nothing beside them. The chunks are independent
(attention mixes tokens within one sequence, never across the batch), so each chunk's values are
the whole block's rows; the GEMMs run on fewer rows each, which may change their rounding (each
backend picks its kernels per shape), and the weight gradient is a sum of k partial GEMMs.

Nodes, per block call: _SplitBatch splits the input into chunk views, each chunk passes through
_StartInputGradSum (identity forward; backward starts the all-reduce of that chunk's summed
input gradient and returns its output), and _SplitBatch's backward waits for every chunk's
all-reduce before concatenating. Autograd's engine runs, of the ready nodes, the one created
last first: chunk k-1's whole backward, its all-reduce start, then chunk k-2's, beside it. In
forward, a row-parallel layer without bias inside the block starts its all-reduce and returns at
once (_DeferredAllReduce, identity backward); the block must return that output unchanged (Llama's
attention and MLP do), which is checked after each chunk: an op between the layer and the block's
return would read the sum before it is complete, so that raises.

With PYNCCL_TP_BATCH_COPY_ENGINE=1, where the group has symmetric memory with the copy engines
(comm/symmetric.py), each sum is instead a copy-engine all-gather of the partials into symmetric
buffers (per chunk, reused by every block) and a sum on the compute stream after the wait
(_SumGathered; the join sums the gathered input gradients): the collective holds no SM beside
the next chunk's GEMMs. The sum over ranks then runs in rank order on every rank.

Opt-in, and measured slower (2xH200, eager Llama 1.1B at tp 2, benchmarks/RESULTS.md, session 18:
off 114.8-121.7 ms a step, 2 chunks 136-162 with the all-reduce and 178-179 with the copy engine,
4 chunks 213-268): the eager step is already near its host's pace (the same 16-layer step with
tiny GPU work takes 72 ms on one GPU and 76 at tp 2), and k chunks run each block's Python k
times (+72 ms a step for 2 chunks there). PYNCCL_TP_BATCH_CHUNKS=k (k > 1 chunks; 1 or unset:
off), read at every block call. Off also where it cannot act: traced by torch.compile (a Work cannot be held in a graph), a block
whose PrepareModuleInput re-lays anything but Replicate() -> Replicate() (sequence parallelism),
a batch that k does not divide, or a call with an argument other than tensors, numbers, strings
and None (a KV cache: each chunk would extend it as if it were the next tokens).
"""
from __future__ import annotations

import os
from typing import Callable, List, Union

import torch

from ..comm import collectives
from ..comm import distributed as dist
from ..comm.reduce_op import ReduceOp
from ..comm.symmetric import alloc_symmetric, symmetric_support
from .plan import GRAD_REDUCED_BY

ENV = "PYNCCL_TP_BATCH_CHUNKS"
CE_ENV = "PYNCCL_TP_BATCH_COPY_ENGINE"
_SLOTS_ATTR = "_pynccl_tp_batch_slots"


def chunks_requested() -> int:
    """PYNCCL_TP_BATCH_CHUNKS: the number of batch chunks (an int >= 1; unset or 1: off)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return 1
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"{ENV} must be an integer >= 1 (the batch chunks of each tensor-parallel block; "
                         f"1: off), got {value!r}")
    return k


def _copy_engine(group) -> bool:
    """PYNCCL_TP_BATCH_COPY_ENGINE=1: this group's sums go as a copy-engine all-gather into symmetric
    buffers plus a sum on the compute stream (no SM held by the collective), not NCCL's all-reduce
    kernels (which, beside the next chunk's GEMMs, take SMs from them), where the group's
    symmetric_support has the copy engines (collective the first time). Off by default: slower
    than the all-reduce on the eager step measured (2xH200, benchmarks/RESULTS.md, session 18)."""
    value = os.environ.get(CE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{CE_ENV} must be 0 or 1, got {value!r}")
    if value != "1" or group.backend_name != "nccl":
        return False
    return symmetric_support(group).copy_engine


def _slots(group, role: str, i: int, shape, dtype):
    """(send, recv) symmetric buffers for chunk i's gather: send shaped like the chunk, recv
    (tp, *shape); reused by every block (each block's sum reads recv before the next block's
    gather is queued behind it). One window per (role, chunk, dtype), sized by the first shape
    asked: a later shape reuses its leading elements where it fits, else gets None (that sum
    takes the all-reduce), so windows never pile up as shapes vary. None also where no window
    could be had. Collective the first time per key: every rank reaches the same keys in the
    same order with the same shapes."""
    cache = group.__dict__.setdefault(_SLOTS_ATTR, {})
    n, numel = dist.get_world_size(group), 1
    for d in shape:
        numel *= d
    key = (role, i, dtype)
    if key not in cache:
        bufs = alloc_symmetric(group, [(numel, dtype), (n * numel, dtype)])
        cache[key] = None if bufs is None else (numel, bufs[0], bufs[1])
    held = cache[key]
    if held is None or numel > held[0]:
        return None
    _, send, recv = held
    # NOTE: recv holds rank r's chunk at [r*numel, (r+1)*numel), as all_gather_into_tensor writes it.
    return send[:numel].view(shape), recv[:n * numel].view((n,) + tuple(shape))


def _start_sum(t: torch.Tensor, group, role: str, index: int, own: bool):
    """Start the sum of t over `group`: (the tensor standing for it, Work, recv). Copy-engine
    variant (_copy_engine): t's partial is gathered into the chunk's symmetric buffers and recv
    holds them, to sum after the wait; t stands as it is. Else an all-reduce in place: on t where
    it is `own` (fresh, nobody else's), else on a copy, which stands for the sum; recv None."""
    slots = _slots(group, role, index, t.shape, t.dtype) if _copy_engine(group) else None
    if slots is not None:
        send, recv = slots
        send.copy_(t)
        return t, collectives.all_gather_into_tensor(recv, send, group=group, async_op=True), recv
    if not own:
        t = t.clone(memory_format=torch.contiguous_format)
    return t, collectives.all_reduce(t, ReduceOp.SUM, group=group, async_op=True), None


class _SumGathered(torch.autograd.Function):
    """The sum over ranks of a gathered partial output (recv: (tp, ...)), in place of `partial`
    (the row-parallel layer's local output, whose gradient is the sum's: identity backward)."""

    @staticmethod
    def forward(ctx, partial, recv):
        return recv.sum(0, dtype=recv.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Chunk:
    """The row-parallel outputs deferred while one chunk of one block runs: [output, Work, recv]
    (recv: the gathered partials to sum after the wait; None where the all-reduce ran in place)."""

    def __init__(self, index: int):
        self.index, self.deferred = index, []


_active: List[_Chunk] = []   # a stack: a block inside a block's chunk defers into its own


def deferring() -> bool:
    """Whether a row-parallel layer called now is inside a chunk of a batch-chunked block."""
    return bool(_active)


class _DeferredAllReduce(torch.autograd.Function):
    """Forward: start the all-reduce (sum) of a fresh row-parallel partial output in place and
    return it at once; the block's wrapper waits for it. Backward: identity (as g's)."""

    @staticmethod
    def forward(ctx, y, group, chunk):
        _, work, recv = _start_sum(y, group, f"forward {len(chunk.deferred)}", chunk.index, own=True)
        chunk.deferred.append([None, work, recv])
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def reduce_deferred(y: torch.Tensor, group) -> torch.Tensor:
    """The sum over `group` of y (fresh, contiguous, nobody else's), started now; valid once the
    enclosing block's wrapper has waited, after the chunk returns."""
    chunk = _active[-1]
    out = _DeferredAllReduce.apply(y.contiguous(), group, chunk)
    chunk.deferred[-1][0] = out
    return out


class _StartInputGradSum(torch.autograd.Function):
    """Identity forward on one chunk of a block's input. Backward: start the all-reduce of the
    chunk's input gradient (summed over its readers by autograd) on a copy, and return the copy;
    _SplitBatch's backward waits for it (pending is that node's list)."""

    @staticmethod
    def forward(ctx, x, group, pending, index):
        ctx.group, ctx.pending, ctx.index = group, pending, index
        return x

    @staticmethod
    def backward(ctx, grad):
        # NOTE: not own: autograd may hand the same tensor to several places (see comm._CopyToRegion).
        out, work, recv = _start_sum(grad, ctx.group, "backward", ctx.index, own=False)
        ctx.pending.append((ctx.index, work, recv))   # recv: _SplitBatch sums the gathered partials
        return out, None, None, None


class _SplitBatch(torch.autograd.Function):
    """x -> k views along dim 0. Backward: wait for every chunk's input-gradient all-reduce (the
    _StartInputGradSum nodes hold `pending`), then concatenate."""

    @staticmethod
    def forward(ctx, x, k, pending):
        ctx.pending = pending
        return tuple(x.chunk(k, dim=0))

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        for index, work, recv in ctx.pending:
            work.wait()
            if recv is not None:
                grads[index] = recv.sum(0, dtype=recv.dtype)
        ctx.pending.clear()
        return torch.cat(grads, dim=0), None, None


def _plain(value) -> bool:
    """Whether an argument can be split by _split_other: a tensor, None, a number, a string, or
    a tuple / list of those. Anything else (a KV cache, which each chunk would append to as if it
    were the next tokens) keeps the block whole."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def splittable(args: tuple, kwargs: dict) -> bool:
    return all(_plain(v) for v in args) and all(_plain(v) for v in kwargs.values())


def _split_other(value, b: int, k: int, i: int):
    """Chunk i of an argument other than the block's input: tensors of >= 2 dims whose dim 0 is the
    batch are split (an attention mask [b, 1, s, s]); the rest (rotary tables [1, s, d], position
    ids, None, flags) pass whole. Tuples and lists are split element by element."""
    if isinstance(value, torch.Tensor):
        return value.chunk(k, dim=0)[i] if value.dim() >= 2 and value.shape[0] == b else value
    if isinstance(value, (tuple, list)):
        return type(value)(_split_other(v, b, k, i) for v in value)
    return value


def _check_returned(chunk: _Chunk, out, name: str) -> None:
    returned = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else []
    for y, _, _ in chunk.deferred:
        if not any(r is y for r in returned):
            raise RuntimeError(
                f"{name}: {ENV} runs this block per batch chunk and defers its row-parallel layer's all-reduce to "
                f"the block's return, but the block did not return that layer's output unchanged (an op between "
                f"them, e.g. a dropout, read it before the sum was complete). Unset {ENV} for this model.")


def _finish(out, sums: dict):
    """The block's output with each deferred partial replaced by its sum (in place already where
    the all-reduce ran: sums has no entry)."""
    if isinstance(out, torch.Tensor):
        return sums.get(id(out), out)
    if isinstance(out, (tuple, list)):
        return type(out)(_finish(o, sums) for o in out)
    return out


def _concat(outs: list):
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([o[j] for o in outs]) for j in range(len(first)))
    return first   # None, or a non-tensor the block returns (the same for every chunk)


def run_chunked(inner: Callable, args: tuple, kwargs: dict, key: Union[int, str], group, k: int, name: str):
    """inner(*args, **kwargs) as k batch chunks. args[key] (an int) or kwargs[key] is the block's
    input made whole: each chunk of it is read through _StartInputGradSum and tagged
    GRAD_REDUCED_BY for the ColwiseParallel readers (its gradient is summed here, once)."""
    x = args[key] if isinstance(key, int) else kwargs[key]
    b = x.shape[0]
    pending: list = []
    pieces = _SplitBatch.apply(x, k, pending) if x.requires_grad else x.chunk(k, dim=0)
    outs, chunks = [], []
    for i, piece in enumerate(pieces):
        if x.requires_grad and torch.is_grad_enabled():
            piece = _StartInputGradSum.apply(piece, group, pending, i)
        setattr(piece, GRAD_REDUCED_BY, group)
        a = tuple(piece if j == key else _split_other(v, b, k, i) for j, v in enumerate(args))
        kw = {name_: piece if name_ == key else _split_other(v, b, k, i) for name_, v in kwargs.items()}
        chunk = _Chunk(i)
        _active.append(chunk)
        try:
            out = inner(*a, **kw)
        finally:
            _active.pop()
        _check_returned(chunk, out, name)
        outs.append(out)
        chunks.append(chunk)
    sums = {}
    for chunk in chunks:
        for out, work, recv in chunk.deferred:
            work.wait()
            if recv is not None:
                sums[id(out)] = _SumGathered.apply(out, recv)
    return _concat([_finish(out, sums) for out in outs])
