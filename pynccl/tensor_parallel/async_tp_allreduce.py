"""Tensor parallelism without sequence parallelism, with its all-reduces overlapped with GEMMs
(on by default: PYNCCL_TP_ASYNC unset or auto, or 1; async_tp.enabled; eager and torch.compile alike):

* linears, then the input gradient's all-reduce (a block input read by column-parallel
  projections, or one ColwiseParallel layer with a replicated input): in backward the input
  gradient's partial sum, sum_i grad_y_i @ w_i, is computed first and its all-reduce starts at
  once; the weight GEMMs grad_y_i^T @ x run beside it (Megatron's async input-gradient all-reduce,
  here for q, k and v together, or gate and up together, in one op).
* linear, then all-reduce (a row-parallel projection with a replicated output): the GEMM runs in
  `chunks` slices of the tokens, each slice's all-reduce started as soon as it is computed, so
  every all-reduce but the last runs beside the next slice's GEMM.

How a sum over the group is made (PYNCCL_TP_ASYNC_SUM, read at every call):

* `gather` (the default where the group's all-gathers on symmetric memory run on the copy engines,
  comm/symmetric.py): every rank's partial is computed into its slot of a symmetric window,
  all-gathered there on the copy engines, and summed on the compute stream in rank order (every
  rank the same sum). The copies hold no SM: a GEMM beside a 2 x 32 MiB gather slowed 4-5 %, beside
  NCCL's 32 MiB all-reduce 29 % and beside its symmetric kernel 43 %, and the gather took 0.103 ms
  against the all-reduce's 0.138 (2xH200, benchmarks/sm_contention.py, session 22). It moves
  world_size - 1 partials into each rank where a ring all-reduce moves 2 (world_size - 1) / world_size.
* `all_reduce` (the default otherwise): NCCL's all-reduce. Where the group has symmetric memory the
  sums are computed into one symmetric window per group and reduced there (NCCL's symmetric
  kernels), then copied out on the comm stream.

Ops (opaque to dynamo and inductor; on NCCL the body is C++, csrc/tp_overlap.cpp):

    pynccl::tp_linears_all_reduce_backward(Tensor x, Tensor[] weights, Tensor[] grad_ys, Tensor? grad_x,
                                           int group_size, str group_name) -> Tensor[]
        [sum over ranks of (grad_x + sum_i grad_y_i @ w_i), grad_y_i^T @ x for each i]
    pynccl::tp_linear_all_reduce(Tensor h, Tensor weight, int chunks, int group_size, str group_name)
        -> Tensor     sum over ranks of h @ weight^T

Bias-free, as async_tp.py's: callers add a bias after (whole, once).

Under autocast the input gradient's partial and its sum over ranks are in autocast's dtype, as
Megatron's async input-gradient all-reduce (bf16); the plain path rounds each projection's
gradient to bf16 and sums those in float32, so this path's error is about twice the plain path's
(relative rms 2.96e-3 against 1.67e-3 of the exact sum, q|k|v at tp 2, simulated), both bf16's
rounding. Float32 partials were measured at +0.17 ms a layer at Llama 1.1B's tp 2 shapes on an
H200 (the extra bytes of float32 GEMM outputs and sums; benchmarks/RESULTS.md, session 23).
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..comm import collectives
from ..comm.functional_collectives import _checked_group, define_op
from ..comm.groups import resolve_group
from ..comm.symmetric import scratch_window, symmetric_support
from .overlap_ops import check_weights, compute_dtype, dense_grads, mm_into, native

DEFAULT_CHUNKS = 0   # RESULTS, session 20: the sliced forward measured slower on 2xH200


def chunks_requested() -> int:
    """PYNCCL_TP_ASYNC_CHUNKS (default 0): the token slices of a row-parallel GEMM whose all-reduces
    are pipelined with it; 0: that all-reduce is left whole, after the GEMM (the plain path), and
    only the backward overlap acts."""
    value = os.environ.get("PYNCCL_TP_ASYNC_CHUNKS", str(DEFAULT_CHUNKS))
    if not value.isdigit():
        raise ValueError(f"PYNCCL_TP_ASYNC_CHUNKS must be a non-negative integer, got {value!r}")
    return int(value)


def row_slices(rows: int, chunks: int) -> List[tuple]:
    """(first row, rows) of each of min(chunks, rows) slices, as even as integers allow (the C++
    body slices the same way)."""
    k = max(1, min(chunks, rows))
    return [(c * rows // k, (c + 1) * rows // k - c * rows // k) for c in range(k)]


SUM_ENV = "PYNCCL_TP_ASYNC_SUM"
_SUM_MODES = ("auto", "gather", "all_reduce")


def sums_by_gather(group) -> bool:
    """Whether this group's sums are all-gathers of the partials then a local sum (PYNCCL_TP_ASYNC_SUM:
    auto (default): where the group's all-gathers run on the copy engines; gather; all_reduce)."""
    mode = os.environ.get(SUM_ENV, "auto")
    if mode not in _SUM_MODES:
        raise ValueError(f"{SUM_ENV} must be one of {', '.join(_SUM_MODES)}, got {mode!r}")
    if mode == "auto":
        return group.world_size > 1 and symmetric_support(group).copy_engine
    return mode == "gather"


# The group's symmetric windows (comm/symmetric.py's scratch_window), one per way of summing.
# NOTE: one window per group serves every op: each op's sum is out of it before the op returns (on
# the comm stream or the caller's, which the caller's stream is ordered after), so the next op may
# reuse it.
_SCRATCH_KEY = "tp_all_reduce"
_GATHER_KEY = "tp_gathered_partials"


def _native_call(g, name: str, nbytes: int, gather: bool):
    """(the C++ body, its scratch window) on NCCL, or None: gloo, or the gather path without a
    symmetric window (the Python reference below runs it with ordinary buffers)."""
    body = native(g, name)
    if body is None:
        return None
    if not gather:
        return body, scratch_window(g, _SCRATCH_KEY, nbytes)
    window = scratch_window(g, _GATHER_KEY, g.world_size * nbytes)
    return None if window is None else (body, window)


def _sum_gathered(parts: torch.Tensor, out: torch.Tensor) -> None:
    """out = the sum over dim 0 of parts (every rank's partial, rank order), as the C++ body sums."""
    if parts.shape[0] == 2:
        torch.add(parts[0], parts[1], out=out)
    else:
        torch.sum(parts, dim=0, out=out)


# --------------------------------------------------- linears, then the input grad's all-reduce
def _linears_all_reduce_backward(x: torch.Tensor, weights: List[torch.Tensor], grad_ys: List[torch.Tensor],
                                 grad_x: Optional[torch.Tensor], group_size: int,
                                 group_name: str) -> List[torch.Tensor]:
    g = _checked_group(group_name, group_size)
    check_weights("tp_linears_all_reduce_backward", x, weights)
    if not weights or len(grad_ys) != len(weights):
        raise ValueError(f"pynccl::tp_linears_all_reduce_backward: one output gradient per weight, at least one; "
                         f"got {len(grad_ys)} for {len(weights)} weights")
    gather = sums_by_gather(g)
    call = _native_call(g, "tp_linears_all_reduce_backward", x.numel() * x.element_size(), gather)
    if call is not None:
        body, scratch = call
        return body(x, list(weights), list(grad_ys), grad_x, scratch, gather)
    grad_ys = [gy.contiguous() for gy in grad_ys]       # once, for both GEMMs each
    partial = torch.empty_like(x, memory_format=torch.contiguous_format)
    if grad_x is not None:
        partial.copy_(grad_x)
    for i, (gy, w) in enumerate(zip(grad_ys, weights)):
        mm_into(partial, gy, w, accumulate=grad_x is not None or i > 0)  # (.., out_i/tp) @ (out_i/tp, h)
    if gather:
        parts = x.new_empty((g.world_size,) + tuple(x.shape))
        work = collectives.all_gather_into_tensor(parts, partial, group=g, async_op=True)
    else:
        work = collectives.all_reduce(partial, group=g, async_op=True)
    x2 = x.reshape(-1, x.shape[-1])
    grad_ws = [gy.reshape(-1, gy.shape[-1]).t() @ x2 for gy in grad_ys]  # beside the collective
    work.wait()
    if gather:
        _sum_gathered(parts, partial)
    return [partial] + grad_ws


def _linears_all_reduce_backward_fake(x, weights, grad_ys, grad_x, group_size, group_name):
    # NOTE: contiguous, as the mm results: a weight may come in transposed (Conv1D's w.t())
    return [torch.empty_like(x, memory_format=torch.contiguous_format)] + [w.new_empty(w.shape) for w in weights]


linears_all_reduce_backward_op = define_op(
    "tp_linears_all_reduce_backward(Tensor x, Tensor[] weights, Tensor[] grad_ys, Tensor? grad_x, int group_size, "
    "str group_name) -> Tensor[]", _linears_all_reduce_backward, _linears_all_reduce_backward_fake)


class _Linears(torch.autograd.Function):
    """(x, *[x @ w^T for w in weights]); backward: tp_linears_all_reduce_backward (x's gradient
    summed over the group, overlapped with the weight GEMMs)."""

    @staticmethod
    def forward(ctx, x, group_size, group_name, *weights):
        ctx.set_materialize_grads(False)   # an unused output's gradient stays None: no zeros summed
        ctx.save_for_backward(x, *weights)
        ctx.args = (group_size, group_name)
        return (x.view_as(x),) + tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, grad_x, *grad_ys):
        x, *weights = ctx.saved_tensors
        grads = linears_all_reduce_backward_op(x, weights, dense_grads(grad_ys, x, weights), grad_x, *ctx.args)
        return (grads[0], None, None, *grads[1:])


# -------------------------------------------------------------------- linear, then all-reduce
def _linear_all_reduce(h: torch.Tensor, weight: torch.Tensor, chunks: int, group_size: int,
                       group_name: str) -> torch.Tensor:
    g = _checked_group(group_name, group_size)
    check_weights("tp_linear_all_reduce", h, [weight])
    if chunks < 1:
        raise ValueError(f"pynccl::tp_linear_all_reduce: chunks must be >= 1, got {chunks}")
    out_shape = tuple(h.shape[:-1]) + (weight.shape[0],)
    gather = sums_by_gather(g)
    call = _native_call(g, "tp_linear_all_reduce", math.prod(out_shape) * h.element_size(), gather)
    if call is not None:
        body, scratch = call
        return body(h, weight, chunks, scratch, gather)
    h2 = h.reshape(-1, h.shape[-1])
    out = h.new_empty(out_shape)
    out2 = out.view(-1, out.shape[-1])
    slices = row_slices(h2.shape[0], chunks)
    works, blocks = [], []
    for lo, n in slices:
        if gather:   # every rank's partial of these rows, rank after rank (the C++ body's window layout)
            own = h.new_empty((n, weight.shape[0]))
            torch.mm(h2.narrow(0, lo, n), weight.t(), out=own)
            blocks.append(h.new_empty((g.world_size, n, weight.shape[0])))
            works.append(collectives.all_gather_into_tensor(blocks[-1], own, group=g, async_op=True))
            continue
        piece = out2.narrow(0, lo, n)
        torch.mm(h2.narrow(0, lo, n), weight.t(), out=piece)             # this slice's partial product
        works.append(collectives.all_reduce(piece, group=g, async_op=True))  # summed beside the next slice
    for i, work in enumerate(works):
        work.wait()
        if gather:
            lo, n = slices[i]
            _sum_gathered(blocks[i], out2.narrow(0, lo, n))
    return out


def _linear_all_reduce_fake(h, weight, chunks, group_size, group_name):
    return h.new_empty(tuple(h.shape[:-1]) + (weight.shape[0],))


linear_all_reduce_op = define_op(
    "tp_linear_all_reduce(Tensor h, Tensor weight, int chunks, int group_size, str group_name) -> Tensor",
    _linear_all_reduce, _linear_all_reduce_fake)


class _LinearAllReduce(torch.autograd.Function):
    """tp_linear_all_reduce(h, weight); backward: the output's gradient is whole on every rank, so
    this rank's gradients need no collective (grad_out @ w, grad_out^T @ h)."""

    @staticmethod
    def forward(ctx, h, weight, chunks, group_size, group_name):
        ctx.save_for_backward(h, weight)
        return linear_all_reduce_op(h, weight, chunks, group_size, group_name)

    @staticmethod
    def backward(ctx, grad_out):
        h, weight = ctx.saved_tensors
        grad_h = grad_out @ weight                                                    # (.., out) @ (out, in/tp)
        grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t() @ h.reshape(-1, h.shape[-1])  # (out, in/tp)
        return grad_h, grad_w, None, None, None


# -------------------------------------------------------------------- what the styles call
def worth_it(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether linears() is the path for this call: autograd records it, and x and every weight need
    their gradients (the op computes them all; a frozen weight, as under LoRA, or an input without a
    gradient take the plain path, which skips what is not needed)."""
    return torch.is_grad_enabled() and x.requires_grad and all(w.requires_grad for w in weights)


def linears(x: torch.Tensor, weights: Sequence[torch.Tensor], group):
    """(x, [x @ w^T for w in weights]) where x is replicated over the group: x's gradient (from the
    outputs and from x itself) is summed over the group in backward, that all-reduce overlapped with
    the weight-gradient GEMMs. Under autocast the inputs are cast as F.linear would cast them, and the
    x returned is in autocast's dtype (the callers' readers are the projections, which cast it so)."""
    dtype = compute_dtype(x, weights)
    g = resolve_group(group)
    out = _Linears.apply(x.to(dtype), g.world_size, g.name, *[w.to(dtype) for w in weights])
    # NOTE: a view, free: callers tag it (GRAD_REDUCED_BY, attach_precomputed); see async_tp.gather_linears
    return out[0].view_as(out[0]), out[1:]


def linear_all_reduce(h: torch.Tensor, weight: torch.Tensor, group, chunks: int) -> torch.Tensor:
    """sum over the group of h @ weight^T (every rank's partial product), each of `chunks` token
    slices' all-reduce beside the next slice's GEMM."""
    dtype = compute_dtype(h, [weight])
    g = resolve_group(group)
    return _LinearAllReduce.apply(h.to(dtype), weight.to(dtype), chunks, g.world_size, g.name)
