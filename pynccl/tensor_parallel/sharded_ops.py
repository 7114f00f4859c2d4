"""The forward of every sharded layer, as a function of this rank's weights and of the activation
layout: column-parallel and row-parallel linears and the vocabulary-parallel embedding. They are
the one implementation behind both ways of building a tensor-parallel model: the Megatron-layout
layers (layers.py, sequence on dim 0 of [s, b, h]) and the plan's styles (styles.py, Hugging
Face's [b, s, h], sequence on dim 1). The layout is the `seq_dim` argument, nothing more.

Each composes the autograd ops of comm.py with F.linear / F.embedding (Megatron,
arXiv:1909.08053 §3; sequence parallelism arXiv:2205.05198 §4.2). At TP size 1 no collective runs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..comm import distributed as dist
from . import async_tp, async_tp_allreduce, batch_overlap
from .comm import (allreduce_grads_in_backward, gather_from_tensor_parallel_region, linear_with_tensor_parallel_input,
                   reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
                   scatter_to_tensor_parallel_region)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group=None,
                           sequence_parallel: bool = False, gather_output: bool = False, seq_dim: int = 0, *,
                           input_grad_summed: bool = False, overlap_gemm: bool = False) -> torch.Tensor:
    """Y_r = X W_r^T + b_r, W_r this rank's rows of W (out/tp, in). X is replicated (its gradient
    is all-reduced here, overlapped with the weight-gradient GEMM), or with sequence_parallel this
    rank's shard of the sequence dim `seq_dim`, all-gathered here (its gradient reduce-scattered).
    gather_output: all-gather the output features. input_grad_summed: X was made whole upstream by
    a re-layout that also sums its gradient (PrepareModuleInput), so nothing is reduced here.
    overlap_gemm: the all-gather overlapped with this rank's own chunk's GEMM (sequence_parallel,
    async_tp.py), or X's gradient all-reduce with the weight GEMM (async_tp_allreduce.py).
    Also the tied LM head: W = the vocabulary-parallel embedding's weight gives this rank's
    vocabulary slice of the logits."""
    if input_grad_summed:
        y = F.linear(x, weight, bias)  # (.., in) @ (in, out/tp) -> (.., out/tp)
    elif overlap_gemm and dist.get_world_size(group) > 1 and (sequence_parallel or
                                                              async_tp_allreduce.worth_it(x, [weight])):
        if sequence_parallel:
            _, (y,) = async_tp.gather_linears(x, [weight], group, seq_dim)  # (.., s/tp, .., in) -> (.., s, .., out/tp)
        else:        # x's gradient all-reduced beside the weight GEMM, traced too
            _, (y,) = async_tp_allreduce.linears(x, [weight], group)  # (.., in) -> (.., out/tp)
        y = y if bias is None else y + bias.to(y.dtype)  # F.linear's dtype under autocast
    else:
        y = linear_with_tensor_parallel_input(x, weight, bias, group, sequence_parallel, seq_dim)  # -> (.., out/tp)
    return gather_from_tensor_parallel_region(y, group) if gather_output else y  # -> (.., out)


def sum_partial_outputs(y: torch.Tensor, bias: Optional[torch.Tensor], group, sequence_parallel: bool = False,
                        seq_dim: int = 0) -> torch.Tensor:
    """Every rank's partial output summed (all-reduce; with sequence_parallel a reduce-scatter that
    leaves this rank's shard of dim seq_dim), then the bias added once. `y` must be fresh (nobody
    else holds it): the all-reduce writes it in place."""
    if sequence_parallel:
        y = reduce_scatter_to_sequence_parallel_region(y, group, seq_dim)  # (.., s, ..) -> (.., s/tp, ..)
        return _add_bias_to_shard(y, bias, group)
    elif bias is None and batch_overlap.deferring() and not torch.compiler.is_compiling():
        return batch_overlap.reduce_deferred(y, group)  # the sum completes beside the block's next chunk
    else:
        y = reduce_from_tensor_parallel_region(y, group, inplace=True)
    return y if bias is None else y + bias


def _add_bias_to_shard(y: torch.Tensor, bias: Optional[torch.Tensor], group) -> torch.Tensor:
    """y, this rank's sequence shard of a summed output, plus the whole bias. The bias now meets only
    this rank's tokens, so its gradient is a partial sum: summed over the group in backward."""
    if bias is None:
        return y
    bias, = allreduce_grads_in_backward((bias,), group)
    return y + bias


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group=None,
                        input_is_parallel: bool = True, sequence_parallel: bool = False,
                        seq_dim: int = 0, overlap_gemm: bool = False, all_reduce_slices: int = 0) -> torch.Tensor:
    """Y = sum_r X_r W_r^T + b, W_r this rank's columns of W (out, in/tp). X is this rank's slice
    of the input features, or the whole input with input_is_parallel=False (sliced here). The
    partial products are summed by sum_partial_outputs (with sequence_parallel, into this rank's
    shard of dim seq_dim) and the bias is added once, after the sum. overlap_gemm: with
    sequence_parallel each peer's chunk of the product is sent as soon as it is computed
    (async_tp.py); without, with all_reduce_slices > 0, the GEMM runs in that many token slices,
    each slice's all-reduce beside the next slice's GEMM (async_tp_allreduce.py)."""
    if dist.get_world_size(group) == 1:
        return F.linear(x, weight, bias)  # nothing to reduce: keep the fused bias epilogue
    if not input_is_parallel:
        x = scatter_to_tensor_parallel_region(x, group)  # (.., in) -> (.., in/tp)
    if sequence_parallel and overlap_gemm:
        y = async_tp.linear_reduce_scatter(x, weight, group, seq_dim)  # (.., s, .., in/tp) -> (.., s/tp, .., out)
        return _add_bias_to_shard(y, bias, group)
    if overlap_gemm and all_reduce_slices > 0 and not batch_overlap.deferring():  # a batch chunk defers instead
        y = async_tp_allreduce.linear_all_reduce(x, weight, group, all_reduce_slices)  # (.., in/tp) -> (.., out)
        return y if bias is None else y + bias   # promoted as the plain path's sum_partial_outputs
    y = F.linear(x, weight)  # (.., in/tp) @ (in/tp, out) -> (.., out), a partial sum
    return sum_partial_outputs(y, bias, group, sequence_parallel, seq_dim)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int, group=None,
                             padding_idx: Optional[int] = None, sequence_parallel: bool = False,
                             seq_dim: int = 0) -> torch.Tensor:
    """Embedding lookup with the vocabulary split: this rank holds rows [vocab_start, vocab_start +
    weight.shape[0]) and looks up the tokens that fall there, zeros elsewhere; the sum over ranks
    (sum_partial_outputs) is the lookup. padding_idx: a global id whose row gets no gradient."""
    if dist.get_world_size(group) == 1:
        y = F.embedding(tokens, weight, padding_idx)
    else:
        rows = weight.shape[0]
        outside = (tokens < vocab_start) | (tokens >= vocab_start + rows)
        local = (tokens - vocab_start).masked_fill(outside, 0)
        local_pad = padding_idx - vocab_start if padding_idx is not None and 0 <= padding_idx - vocab_start < rows \
            else None
        # (.., s) -> (.., s, h): rows of this rank's tokens, zeros elsewhere.
        y = F.embedding(local, weight, local_pad).masked_fill(outside.unsqueeze(-1), 0.0)
    return sum_partial_outputs(y, None, group, sequence_parallel, seq_dim)
