"""Tensor-parallel communication as autograd functions: Megatron's f and g (arXiv:1909.08053 §3)
and the sequence-parallel pair (arXiv:2205.05198 §4.2). Each op's backward is its conjugate
collective, so the layers in layers.py are plain compositions of these and F.linear. The one
fused op, _ColumnParallelLinear, exists so backward can overlap its collectives with the GEMMs.

Layout: activations are [s, b, h] (sequence first, as Megatron). Sequence parallelism splits
dim 0, so a rank's shard is one contiguous slab and the all-gather / reduce-scatter write and
read it in place, with no transpose copies. Tensor parallelism splits the last dim. The
sequence ops also take seq_dim (1 for Hugging Face's [b, s, h], see plan.py): that dim is moved
to the front around the collective, one copy each way unless the dims before it have size 1.

At TP size 1 every op returns its input untouched: no collective, no copy.

Under torch.compile the collectives are pynccl's custom ops (comm/functional_collectives.py), so
dynamo traces these functions, forward and backward, with no graph break; eager calls take the
direct path. The one difference traced: _ColumnParallelLinear's backward cannot hold async Work
objects, so its collectives run in order there (the graph's scheduler may still reorder them).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ..comm import distributed as dist
from ..comm import functional_collectives as fc


def _tp_size(group) -> int:
    return dist.get_world_size(group)


def _all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, in place where x is contiguous (else on a contiguous copy; traced, a new
    tensor)."""
    return fc.all_reduce(x.contiguous(), group)


def _all_gather_seq(x: torch.Tensor, group, seq_dim: int = 0, async_op: bool = False):
    """(.., n, ..) -> (.., tp * n, ..) along seq_dim: rank r's slab lands at [r*n, (r+1)*n).
    seq_dim 0 is gathered straight into the output; another dim is moved to the front first (a
    copy) and the result is a view with it moved back. With async_op, returns (output, Work)."""
    if seq_dim != 0:
        out = _all_gather_seq(x.movedim(seq_dim, 0), group, 0, async_op)
        return (out[0].movedim(0, seq_dim), out[1]) if async_op else out.movedim(0, seq_dim)
    return fc.all_gather(x, group, async_op)


def _check_seq_divisible(what: str, x: torch.Tensor, tp_size: int, seq_dim: int):
    if x.dim() <= seq_dim or x.shape[seq_dim] % tp_size:
        raise ValueError(f"{what}: the sequence dim (the dim sequence parallelism splits: dim {seq_dim} of shape "
                         f"{tuple(x.shape)}) must be divisible by the tensor-parallel size ({tp_size})")


def _reduce_scatter_seq(x: torch.Tensor, group, seq_dim: int = 0, async_op: bool = False):
    """(.., s, ..) -> (.., s / tp, ..) along seq_dim: rank r keeps the sum of every rank's slab
    [r*s/tp, (r+1)*s/tp). With async_op, returns (output, Work)."""
    tp_size = _tp_size(group)
    _check_seq_divisible("reduce_scatter_to_sequence_parallel_region", x, tp_size, seq_dim)
    if seq_dim != 0:
        out = _reduce_scatter_seq(x.movedim(seq_dim, 0), group, 0, async_op)
        return (out[0].movedim(0, seq_dim), out[1]) if async_op else out.movedim(0, seq_dim)
    return fc.reduce_scatter(x, group, async_op)


def _split_seq(x: torch.Tensor, group, seq_dim: int = 0) -> torch.Tensor:
    tp_size = _tp_size(group)
    _check_seq_divisible("scatter_to_sequence_parallel_region", x, tp_size, seq_dim)
    n = x.shape[seq_dim] // tp_size
    return x.narrow(seq_dim, dist.get_rank(group) * n, n).clone(memory_format=torch.contiguous_format)


def _check_last_divisible(what: str, x: torch.Tensor, tp_size: int):
    if x.dim() == 0 or x.shape[-1] % tp_size:
        raise ValueError(f"{what}: the last dim (of shape {tuple(x.shape)}) must be divisible by the "
                         f"tensor-parallel size ({tp_size})")


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    tp_size = _tp_size(group)
    _check_last_divisible("scatter_to_tensor_parallel_region", x, tp_size)
    return x.chunk(tp_size, dim=-1)[dist.get_rank(group)].contiguous()


def _all_gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """(..., h/tp) -> (..., h), rank order along the last dim."""
    stacked = _all_gather_seq(x.unsqueeze(0), group)  # (tp, ..., h/tp)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], -1)  # (..., tp, h/tp) -> (..., h)


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (entering a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # NOTE: out of place. Autograd may hand the same tensor to several places: in f(x) + w the
        # add's backward passes one grad to both, and w.grad may be that very tensor (issue #18).
        # Traced, the op's result is already a new tensor.
        if torch.compiler.is_compiling():
            return _all_reduce_(grad, ctx.group), None
        return _all_reduce_(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (leaving a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, group, inplace):
        # Traced, the op returns a new tensor anyway: no clone first.
        keep = inplace or torch.compiler.is_compiling()
        return _all_reduce_(x if keep else x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim; backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Keep this rank's slice of the sequence (dim seq_dim); backward all-gathers it."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return _split_seq(x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group, ctx.seq_dim), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence. Backward: reduce-scatter when the gathered tensor feeds a
    tensor-parallel region (each rank's grad is a partial sum), else just this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial, seq_dim):
        ctx.group, ctx.grad_is_partial, ctx.seq_dim = group, grad_is_partial, seq_dim
        return _all_gather_seq(x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_seq(grad, ctx.group, ctx.seq_dim), None, None, None
        return _split_seq(grad, ctx.group, ctx.seq_dim), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence (leaving a row-parallel region); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return _reduce_scatter_seq(x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group, ctx.seq_dim), None, None


class _AllReduceGradsInBackward(torch.autograd.Function):
    """Identity on replicated parameters; backward all-reduces their grads in one collective.

    A replicated parameter used on a sequence shard (LayerNorm, row-parallel bias under sequence
    parallelism) gets only this shard's share of its grad; the sum over the TP group is the
    true grad. Doing the sum inside autograd keeps it right under gradient accumulation, DDP,
    ZeRO and activation recomputation alike, with nothing for the user to call.
    """

    @staticmethod
    def forward(ctx, group, *params):
        ctx.group = group
        return params if len(params) > 1 else params[0]

    @staticmethod
    def backward(ctx, *grads):
        # NOTE: grads of unused params arrive as zeros (materialize_grads), so every rank
        # reduces the same sizes.
        flat = fc.all_reduce(torch.cat([g.reshape(-1) for g in grads]), ctx.group)
        out = [chunk.view_as(g).to(g.dtype) for chunk, g in zip(flat.split([g.numel() for g in grads]), grads)]
        return (None, *out)


class _ColumnParallelLinear(torch.autograd.Function):
    """f (or the sequence all-gather) fused with the matmul, so that backward can overlap its
    collectives with the GEMMs (Megatron's LinearWithGradAccumulationAndAsyncCommunication):

        sequence parallel: all-gather X again (async) | dX = dY W  ; then reduce-scatter dX (async) | dW = dY^T X
        otherwise:                                      dX = dY W  ; then all-reduce dX (async)     | dW = dY^T X

    With sequence parallelism only this rank's input shard is saved for backward, and the gathered
    input is rebuilt there (arXiv:2205.05198 §4.2.2: activation memory is what it is for).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim):
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.seq_dim = seq_dim
        total = _all_gather_seq(x, group, seq_dim) if sequence_parallel else x  # (s/tp, b, in) -> (s, b, in)
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(total, weight, bias)  # (s, b, in) @ (in, out/tp) -> (s, b, out/tp)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gather_work = None
        if ctx.sequence_parallel and need_dw:
            total, gather_work = _all_gather_seq(x, ctx.group, ctx.seq_dim, async_op=True)
        else:
            total = x
        dx = work = None
        if need_dx:
            dx = dy.matmul(weight.to(dy.dtype))  # (s, b, out/tp) @ (out/tp, in) -> (s, b, in), partial sum
            if ctx.sequence_parallel:
                dx, work = _reduce_scatter_seq(dx, ctx.group, ctx.seq_dim, async_op=True)  # -> (s/tp, b, in)
            else:
                dx, work = fc.all_reduce_async(dx, ctx.group)
        dw = db = None
        if need_dw:
            if gather_work is not None:
                gather_work.wait()
            dy_2d = dy.reshape(-1, dy.shape[-1])  # (s·b, out/tp)
            dw = dy_2d.t().matmul(total.reshape(-1, total.shape[-1]).to(dy.dtype)).to(weight.dtype)  # (out/tp, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        if work is not None:
            work.wait()
        return (dx.to(x.dtype) if dx is not None else None), dw, (None if db is None else db.to(weight.dtype)), \
            None, None, None


# ----------------------------------------------------------------------------- public functions
def copy_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: forward identity, backward all-reduce over `group`."""
    return x if _tp_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group=None, inplace: bool = False) -> torch.Tensor:
    """g: forward all-reduce (sum) over `group`, backward identity. `inplace=True` reduces x's
    own storage (for a fresh matmul output nobody else holds)."""
    return x if _tp_size(group) == 1 else _ReduceFromRegion.apply(x, group, inplace)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., h) -> (..., h/tp): this rank's slice of the last dim; backward all-gathers."""
    return x if _tp_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., h/tp) -> (..., h): all-gather along the last dim; backward keeps this rank's slice."""
    return x if _tp_size(group) == 1 else _GatherFromRegion.apply(x, group)


def _seq_dim_of(x: torch.Tensor, seq_dim: int) -> int:
    if x.dim() == 0 or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim must index a dim of the input of shape {tuple(x.shape)}, got {seq_dim}")
    return seq_dim % x.dim()


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 0) -> torch.Tensor:
    """(s, b, h) -> (s/tp, b, h): this rank's slice of the sequence; backward all-gathers.
    seq_dim: where the sequence is (0 in Megatron's [s, b, h], 1 in Hugging Face's [b, s, h])."""
    return x if _tp_size(group) == 1 else _ScatterToSequenceRegion.apply(x, group, _seq_dim_of(x, seq_dim))


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None, grad_is_partial: bool = True,
                                         seq_dim: int = 0) -> torch.Tensor:
    """(s/tp, b, h) -> (s, b, h). Backward reduce-scatters (`grad_is_partial`, the case when the
    result feeds a column-parallel layer) or keeps this rank's slice."""
    if _tp_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, grad_is_partial, _seq_dim_of(x, seq_dim))


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, seq_dim: int = 0) -> torch.Tensor:
    """(s, b, h) -> (s/tp, b, h) summed over `group`; backward all-gathers."""
    return x if _tp_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group, _seq_dim_of(x, seq_dim))


def linear_with_tensor_parallel_input(x: torch.Tensor, weight: torch.Tensor, bias=None, group=None,
                                      sequence_parallel: bool = False, seq_dim: int = 0) -> torch.Tensor:
    """F.linear(f(x), weight, bias), or F.linear(all_gather_seq(x), ...) with sequence_parallel:
    the input side of a column-parallel layer, its backward collectives overlapped with the GEMMs."""
    if _tp_size(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    seq_dim = _seq_dim_of(x, seq_dim) if sequence_parallel else 0
    return _ColumnParallelLinear.apply(x, weight, bias, group, sequence_parallel, seq_dim)


def allreduce_grads_in_backward(params: Sequence[torch.Tensor], group=None) -> Tuple[torch.Tensor, ...]:
    """Returns `params` unchanged for use in forward; their grads are summed over `group` (one
    collective for all of them) when backward reaches this point. Use it for every replicated
    parameter applied to a sequence-parallel shard. None entries pass through."""
    params = tuple(params)
    present = [p for p in params if p is not None]
    if _tp_size(group) == 1 or not present:
        return params
    out = _AllReduceGradsInBackward.apply(group, *present)
    it = iter(out if len(present) > 1 else (out,))
    return tuple(None if p is None else next(it) for p in params)
