"""Sequence-parallel TP with each collective overlapped with the GEMMs beside it (opt-in,
PYNCCL_TP_ASYNC=1 when parallelize_module runs; eager and torch.compile alike; enabled() below
also decides for async_tp_allreduce.py, on by default). The collective
matmul of Wang et al. (ASPLOS '23, "Overlap communication with dependent computation via
decomposition"), the idea behind torch's micro-pipeline TP and Megatron's tp_comm_overlap:

* gather then linear (a block's input, all-gathered along the sequence for its column-parallel
  projections): the all-gather runs on the comm stream while this rank's own sequence chunk goes
  through every projection's GEMM; the peers' chunks follow once they land.
* linear then reduce-scatter (a row-parallel projection leaving the block): the partial product of
  each peer's sequence chunk is computed first and sent to that peer at once; the chunk this rank
  keeps is computed while those travel, then the received partials are added.

Each is a torch op (opaque to dynamo and inductor, so compiled graphs hold them as one node each
and the overlap happens inside; on NCCL the body is C++, csrc/tp_overlap.cpp), wrapped in an
autograd.Function whose backward is the other decomposition:

    pynccl::tp_gather_linears(Tensor x, Tensor[] weights, int seq_dim, int group_size, str group_name)
        -> Tensor[]   [x_full, x_full @ w_1^T, ...]
    pynccl::tp_gather_linears_backward(x_full, weights, grad_ys, grad_x_full?, ...) -> [grad_x, grad_w_1, ...]
    pynccl::tp_linear_reduce_scatter(Tensor h, Tensor weight, int seq_dim, int group_size, str group_name)
        -> Tensor     this rank's sequence chunk of sum_r h_r @ w_r^T
    pynccl::tp_linear_reduce_scatter_backward(grad_out, h, weight, ...) -> [grad_h, grad_w]

A rank's chunk of dim seq_dim is [r*s, (r+1)*s), s = the whole length / the group size, as
comm.py's sequence ops. Bias-free: callers add a bias after (it is whole, summed once).

How the chunks travel on NCCL (PYNCCL_TP_ASYNC_SUM, async_tp_allreduce.sums_by_gather, read at
every call): where the group's collectives on symmetric memory run on the copy engines (`auto`, the
default there, or `gather`), through one symmetric window per group: the all-gather of a chunk
copied into this rank's slot, and the partial sums as one all-to-all of the peers' parts computed
into their slots; the copies hold no SM, so the GEMMs beside them keep the whole GPU. Otherwise
(`all_reduce`, or no copy engines) NCCL's all-gather into ordinary memory and a ring of send/recv
pairs, whose kernels take SMs from those GEMMs. Either way the sums add the same terms in the same
order (the Python reference's).
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

import torch

from ..comm import collectives
from ..comm.functional_collectives import _checked_group, define_op
from ..comm.groups import resolve_group
from ..comm.p2p import P2POp, batch_work, irecv, isend
from ..comm.symmetric import scratch_window
from . import batch_overlap, grad_overlap
from .async_tp_allreduce import sums_by_gather
from .overlap_ops import check_weights, compute_dtype, dense_grads, mm_into, native

PRECOMPUTED_ATTR = "_pynccl_tp_precomputed"   # tensor attribute: ((reader module, its output), ...)


ENV = "PYNCCL_TP_ASYNC"


def enabled(sequence_parallel: bool) -> bool:
    """Whether the styles built by parallelize_module from now on overlap their collectives with the
    GEMMs (read there, once), by PYNCCL_TP_ASYNC:
    * auto (the default, unset): without sequence parallelism (async_tp_allreduce.py), unless one of
      the eager overlaps is asked for there instead (PYNCCL_TP_GRAD_OVERLAP=1, PYNCCL_TP_BATCH_CHUNKS
      > 1); with sequence parallelism no (this file's ops measured slower than the plain path:
      RESULTS, session 19);
    * 1: both; 0: neither (the plain path)."""
    value = os.environ.get(ENV, "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV} must be auto, 0 or 1, got {value!r}")
    if value == "auto":
        return not sequence_parallel and not grad_overlap.enabled() and batch_overlap.chunks_requested() == 1
    return value == "1"


# ------------------------------------------------------------------------------- helpers
# The group's symmetric window for the chunks' exchanges (comm/symmetric.py's scratch_window).
# NOTE: one per group serves every op: each op is done reading it (in the caller's stream order)
# before it returns, and a copy of what outlives the op (tp_gather_linears' whole x) is taken.
_EXCHANGE_KEY = "tp_sequence_exchange"


def _native_call(g, name: str, nbytes: int):
    """(the C++ body, the window its exchange runs in or None) on NCCL, or None (gloo: the Python
    reference below runs). The window where the group's copy engines move chunks (sums_by_gather)
    and one of nbytes could be had; else the body's NCCL kernels on ordinary memory."""
    body = native(g, name)
    if body is None:
        return None
    return body, scratch_window(g, _EXCHANGE_KEY, nbytes) if sums_by_gather(g) else None


def _nbytes(t: torch.Tensor, numel: int) -> int:
    return numel * t.element_size()


def _chunk(t: torch.Tensor, seq_dim: int, n: int, j: int) -> torch.Tensor:
    """Rank j's chunk of dim seq_dim of t (a view)."""
    s = t.shape[seq_dim] // n
    return t.narrow(seq_dim, j * s, s)


def _rank_major_is_natural(shape: Sequence[int], seq_dim: int) -> bool:
    """Whether the chunks of dim seq_dim, stacked rank after rank, are the tensor itself (every dim
    before seq_dim has size 1)."""
    return all(d == 1 for d in shape[:seq_dim])


def _start_gather(local: torch.Tensor, g):
    """(the rank-major buffer, chunk j at rows [j * local.shape[0], ...), its all-gather's Work)."""
    gathered = local.new_empty((g.world_size * local.shape[0],) + tuple(local.shape[1:]))
    return gathered, collectives.all_gather_into_tensor(gathered, local, group=g, async_op=True)


def _natural(gathered: torch.Tensor, local: torch.Tensor, seq_dim: int, n: int) -> torch.Tensor:
    """The whole tensor, chunks along seq_dim, from the rank-major gathered ones (a view where the
    layouts agree, else one copy per chunk)."""
    if _rank_major_is_natural(local.shape, seq_dim):
        return gathered.view(_full_shape(local, seq_dim, n))
    whole = local.new_empty(_full_shape(local, seq_dim, n))
    for j, piece in enumerate(gathered.view(n, *local.shape)):
        _chunk(whole, seq_dim, n, j).copy_(piece)
    return whole


def _send_peer_chunks(partial, g) -> list:
    """Start the ring exchange of the partial sums: step j computes partial((r + j) % n), this rank's
    part of that peer's chunk, sends it there and receives rank r - j's part of this rank's chunk (one
    NCCL group per step). NOTE: peers' chunks first, so what the caller computes next (its own chunk,
    weight GEMMs) runs while they travel. Returns what add_received needs."""
    n, r = g.world_size, g.group_rank
    pending = []
    for j in range(1, n):
        part = partial((r + j) % n)
        recv = torch.empty_like(part)
        work = batch_work([P2POp(isend, part, group=g, group_peer=(r + j) % n),
                           P2POp(irecv, recv, group=g, group_peer=(r - j) % n)])
        pending.append((work, part, recv))
    return pending


def _add_received(own: torch.Tensor, pending: list) -> torch.Tensor:
    """own + every peer's part of this rank's chunk, once each has arrived."""
    for work, _, recv in pending:
        work.wait()
        own.add_(recv)
    return own


def _check_args(what: str, x: torch.Tensor, seq_dim: int, n: int, weights: Sequence[torch.Tensor], whole: bool):
    if x.dim() < 2 or not 0 <= seq_dim < x.dim() - 1:
        raise ValueError(f"pynccl::{what}: seq_dim {seq_dim} must name a dim before the last of the input "
                         f"(shape {tuple(x.shape)})")
    if whole and x.shape[seq_dim] % n:
        raise ValueError(f"pynccl::{what}: the sequence dim (dim {seq_dim} of shape {tuple(x.shape)}) must be "
                         f"divisible by the tensor-parallel size ({n})")
    check_weights(what, x, weights)


def _full_shape(x: torch.Tensor, seq_dim: int, n: int, last: Optional[int] = None) -> List[int]:
    shape = list(x.shape)
    shape[seq_dim] *= n
    if last is not None:
        shape[-1] = last
    return shape


# ------------------------------------------------------------------- gather, then linears
def _gather_linears(x: torch.Tensor, weights: List[torch.Tensor], seq_dim: int, group_size: int,
                    group_name: str) -> List[torch.Tensor]:
    g = _checked_group(group_name, group_size)
    n, r = group_size, g.group_rank
    _check_args("tp_gather_linears", x, seq_dim, n, weights, whole=False)
    call = _native_call(g, "tp_gather_linears", _nbytes(x, n * x.numel()))
    if call is not None:
        body, window = call
        return body(x, list(weights), seq_dim, window)
    xs = x.contiguous()                                        # (.., s, .., h), this rank's chunk
    gathered, work = _start_gather(xs, g)
    ys = [xs.new_empty(_full_shape(xs, seq_dim, n, w.shape[0])) for w in weights]
    for y, w in zip(ys, weights):                              # own chunk, beside the all-gather
        mm_into(_chunk(y, seq_dim, n, r), xs, w.t())           # (.., s, .., h) @ (h, out/tp)
    work.wait()
    pieces = gathered.view(n, *xs.shape)
    x_full = _natural(gathered, xs, seq_dim, n)
    for j in range(n):
        if j != r:
            for y, w in zip(ys, weights):
                mm_into(_chunk(y, seq_dim, n, j), pieces[j], w.t())
    return [x_full] + ys


def _gather_linears_fake(x, weights, seq_dim, group_size, group_name):
    return [x.new_empty(_full_shape(x, seq_dim, group_size))] + \
        [x.new_empty(_full_shape(x, seq_dim, group_size, w.shape[0])) for w in weights]


def _gather_linears_backward(x_full: torch.Tensor, weights: List[torch.Tensor], grad_ys: List[torch.Tensor],
                             grad_x_full: Optional[torch.Tensor], seq_dim: int, group_size: int,
                             group_name: str) -> List[torch.Tensor]:
    g = _checked_group(group_name, group_size)
    n, r = group_size, g.group_rank
    call = _native_call(g, "tp_gather_linears_backward", _nbytes(x_full, 2 * x_full.numel()))
    if call is not None:
        body, window = call
        return body(x_full, list(weights), list(grad_ys), grad_x_full, seq_dim, window)
    grad_ys = [gy.contiguous() for gy in grad_ys]   # once, for the chunk GEMMs and the weight GEMM alike

    def partial_grad_x(j):  # chunk j of sum_i grad_y_i @ w_i (+ grad_x_full): this rank's part of its sum
        out = torch.empty_like(_chunk(x_full, seq_dim, n, j), memory_format=torch.contiguous_format)
        if grad_x_full is not None:
            out.copy_(_chunk(grad_x_full, seq_dim, n, j))
        for k, (gy, w) in enumerate(zip(grad_ys, weights)):
            mm_into(out, _chunk(gy, seq_dim, n, j), w, accumulate=grad_x_full is not None or k > 0)
        return out

    pending = _send_peer_chunks(partial_grad_x, g)   # the weight GEMMs and our own chunk beside them
    x2 = x_full.reshape(-1, x_full.shape[-1])
    grad_ws = [gy.view(-1, gy.shape[-1]).t() @ x2 for gy in grad_ys]  # (out/tp, tokens) @ (tokens, h)
    return [_add_received(partial_grad_x(r), pending)] + grad_ws


def _gather_linears_backward_fake(x_full, weights, grad_ys, grad_x_full, seq_dim, group_size, group_name):
    shape = list(x_full.shape)
    shape[seq_dim] //= group_size
    # NOTE: contiguous, as the mm results: a weight may come in transposed (Conv1D's w.t())
    return [x_full.new_empty(shape)] + [w.new_empty(w.shape) for w in weights]


gather_linears_op = define_op(
    "tp_gather_linears(Tensor x, Tensor[] weights, int seq_dim, int group_size, str group_name) -> Tensor[]",
    _gather_linears, _gather_linears_fake)
gather_linears_backward_op = define_op(
    "tp_gather_linears_backward(Tensor x_full, Tensor[] weights, Tensor[] grad_ys, Tensor? grad_x_full, "
    "int seq_dim, int group_size, str group_name) -> Tensor[]", _gather_linears_backward, _gather_linears_backward_fake)


class _GatherLinears(torch.autograd.Function):
    """[x_full, *ys] = tp_gather_linears(x, weights); backward: tp_gather_linears_backward."""

    @staticmethod
    def forward(ctx, x, seq_dim, group_size, group_name, *weights):
        out = gather_linears_op(x, list(weights), seq_dim, group_size, group_name)
        ctx.save_for_backward(out[0], *weights)
        ctx.args = (seq_dim, group_size, group_name)
        return tuple(out)

    @staticmethod
    def backward(ctx, grad_x_full, *grad_ys):
        x_full, *weights = ctx.saved_tensors
        grads = gather_linears_backward_op(x_full, weights, dense_grads(grad_ys, x_full, weights), grad_x_full,
                                           *ctx.args)
        return (grads[0], None, None, None, *grads[1:])


# ------------------------------------------------------------ linear, then reduce-scatter
def _linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, seq_dim: int, group_size: int,
                           group_name: str) -> torch.Tensor:
    g = _checked_group(group_name, group_size)
    n, r = group_size, g.group_rank
    _check_args("tp_linear_reduce_scatter", h, seq_dim, n, [weight], whole=True)
    out_chunk = math.prod(h.shape[:-1]) // n * weight.shape[0]   # elements of this rank's output
    call = _native_call(g, "tp_linear_reduce_scatter", _nbytes(h, 2 * n * out_chunk))
    if call is not None:
        body, window = call
        return body(h, weight, seq_dim, window)

    def partial(j):  # (.., s, .., in/tp) @ (in/tp, out) -> this rank's part of chunk j's sum
        chunk = _chunk(h, seq_dim, n, j)
        out = h.new_empty(tuple(chunk.shape[:-1]) + (weight.shape[0],))
        mm_into(out, chunk, weight.t())
        return out

    pending = _send_peer_chunks(partial, g)
    return _add_received(partial(r), pending)  # our own chunk computed while the peers' travel


def _linear_reduce_scatter_fake(h, weight, seq_dim, group_size, group_name):
    shape = list(h.shape)
    shape[seq_dim] //= group_size
    shape[-1] = weight.shape[0]
    return h.new_empty(shape)


def _linear_reduce_scatter_backward(grad_out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, seq_dim: int,
                                    group_size: int, group_name: str) -> List[torch.Tensor]:
    g = _checked_group(group_name, group_size)
    n, r = group_size, g.group_rank
    call = _native_call(g, "tp_linear_reduce_scatter_backward", _nbytes(grad_out, n * grad_out.numel()))
    if call is not None:
        body, window = call
        return body(grad_out, h, weight, seq_dim, window)
    go = grad_out.contiguous()                                  # (.., s, .., out), this rank's chunk
    gathered, work = _start_gather(go, g)
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
    mm_into(_chunk(grad_h, seq_dim, n, r), go, weight)         # own chunk beside the all-gather
    work.wait()
    pieces = gathered.view(n, *go.shape)
    for j in range(n):
        if j != r:
            mm_into(_chunk(grad_h, seq_dim, n, j), pieces[j], weight)  # (.., s, .., out) @ (out, in/tp)
    grad_full = _natural(gathered, go, seq_dim, n)
    grad_w = grad_full.reshape(-1, grad_full.shape[-1]).t() @ h.reshape(-1, h.shape[-1])  # (out, in/tp)
    return [grad_h, grad_w]


def _linear_reduce_scatter_backward_fake(grad_out, h, weight, seq_dim, group_size, group_name):
    return [torch.empty_like(h, memory_format=torch.contiguous_format), weight.new_empty(weight.shape)]


linear_reduce_scatter_op = define_op(
    "tp_linear_reduce_scatter(Tensor h, Tensor weight, int seq_dim, int group_size, str group_name) -> Tensor",
    _linear_reduce_scatter, _linear_reduce_scatter_fake)
linear_reduce_scatter_backward_op = define_op(
    "tp_linear_reduce_scatter_backward(Tensor grad_out, Tensor h, Tensor weight, int seq_dim, int group_size, "
    "str group_name) -> Tensor[]", _linear_reduce_scatter_backward, _linear_reduce_scatter_backward_fake)


class _LinearReduceScatter(torch.autograd.Function):
    """tp_linear_reduce_scatter(h, weight); backward: tp_linear_reduce_scatter_backward."""

    @staticmethod
    def forward(ctx, h, weight, seq_dim, group_size, group_name):
        ctx.save_for_backward(h, weight)
        ctx.args = (seq_dim, group_size, group_name)
        return linear_reduce_scatter_op(h, weight, seq_dim, group_size, group_name)

    @staticmethod
    def backward(ctx, grad_out):
        h, weight = ctx.saved_tensors
        grad_h, grad_w = linear_reduce_scatter_backward_op(grad_out, h, weight, *ctx.args)
        return grad_h, grad_w, None, None, None


# -------------------------------------------------------------------- what the styles call
def _seq_dim(what: str, x: torch.Tensor, seq_dim: int) -> int:
    if not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"{what}: seq_dim {seq_dim} is out of range for an input of shape {tuple(x.shape)}")
    return seq_dim % x.dim()


def gather_linears(x: torch.Tensor, weights: Sequence[torch.Tensor], group, seq_dim: int):
    """(x made whole along seq_dim, [x_whole @ w^T for w in weights]) with the all-gather overlapped.
    Under autocast the inputs are cast as F.linear would cast them, so the whole x, the gather and
    x's gradient sum are in autocast's dtype (Megatron's bf16 sequence parallelism; the plain path
    gathers and sums in x's own dtype)."""
    seq_dim = _seq_dim("gather_linears", x, seq_dim)
    dtype = compute_dtype(x, weights)
    g = resolve_group(group)
    out = _GatherLinears.apply(x.to(dtype), seq_dim, g.world_size, g.name, *[w.to(dtype) for w in weights])
    # NOTE: a view, free: dynamo (torch 2.11) cannot set attributes on an autograd.Function's outputs
    # themselves, and the callers tag x_full (GRAD_REDUCED_BY, attach_precomputed).
    return out[0].view_as(out[0]), out[1:]


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group, seq_dim: int) -> torch.Tensor:
    """This rank's chunk (dim seq_dim) of sum_r h_r @ w_r^T, the partial products sent as they are made."""
    seq_dim = _seq_dim("linear_reduce_scatter", h, seq_dim)
    dtype = compute_dtype(h, [weight])
    g = resolve_group(group)
    return _LinearReduceScatter.apply(h.to(dtype), weight.to(dtype), seq_dim, g.world_size, g.name)


def attach_precomputed(x_full: torch.Tensor, readers: Sequence[torch.nn.Module], ys: Sequence[torch.Tensor]) -> None:
    """Hand each reader module its output, computed beside the gather that made x_full."""
    setattr(x_full, PRECOMPUTED_ATTR, tuple(zip(readers, ys)))


def precomputed(x: torch.Tensor, module: torch.nn.Module) -> Optional[torch.Tensor]:
    """The bias-free output gather_linears computed for `module` reading x, or None."""
    for reader, y in getattr(x, PRECOMPUTED_ATTR, ()):
        if reader is module:
            return y
    return None
