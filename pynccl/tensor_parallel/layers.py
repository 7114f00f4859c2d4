"""Sharded nn.Linear, nn.Embedding and a TP-aware LayerNorm (Megatron, arXiv:1909.08053 §3).

Each layer can be built two ways that give the same weights: from its sizes (initialised as the
unsharded torch layer would be under the same RNG state, then sliced, so a model starts the same
at every TP size), or from an existing torch layer (`from_linear`, ...), taking its slice.
Sharded parameters carry `tp_shard_dim` and `tp_num_chunks` (see shard_tensor); parameters
without them are replicated across the TP group (count them once when, e.g., clipping norms).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import distributed as dist
from .comm import (allreduce_grads_in_backward, gather_from_tensor_parallel_region, linear_with_tensor_parallel_input,
                   reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
                   scatter_to_tensor_parallel_region)


def check_divisible(layer: str, name: str, value: int, tp_size: int, num_chunks: int = 1) -> None:
    """ValueError naming the dimension and the TP size when `value` does not split evenly."""
    if value % (num_chunks * tp_size):
        by = f"{num_chunks} fused blocks × " if num_chunks > 1 else ""
        raise ValueError(f"{layer}: {name} ({value}) is not divisible by {by}the tensor-parallel size ({tp_size})")


def shard_tensor(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, num_chunks: int = 1) -> torch.Tensor:
    """Rank `tp_rank`'s slice of `full` along `dim`. With num_chunks > 1 (a fused QKV weight), `dim`
    holds num_chunks equal blocks, each split across ranks, and the rank's slices are concatenated:
    [q | k | v] -> [q_r | k_r | v_r]."""
    blocks = full.chunk(num_chunks, dim) if num_chunks > 1 else (full,)
    return torch.cat([b.chunk(tp_size, dim)[tp_rank] for b in blocks], dim)


def shard_like(param: torch.Tensor, full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of `full` (an unsharded weight, its grad, an optimizer state), cut as
    `param` was cut; `full` itself for a replicated param. A full dim shorter than the sharded one
    (a padded vocabulary) is zero-padded first."""
    dim = getattr(param, "tp_shard_dim", None)
    if dim is None:
        return full
    tp_size = dist.get_world_size(group)
    missing = param.shape[dim] * tp_size - full.shape[dim]
    if missing > 0:
        pad_shape = list(full.shape)
        pad_shape[dim] = missing
        full = torch.cat([full, full.new_zeros(pad_shape)], dim)
    return shard_tensor(full, dim, dist.get_rank(group), tp_size, param.tp_num_chunks)


def _sharded_param(full: torch.Tensor, dim: int, group, num_chunks: int = 1) -> nn.Parameter:
    shard = shard_tensor(full.detach(), dim, dist.get_rank(group), dist.get_world_size(group), num_chunks)
    # clone: a view would keep the whole unsharded tensor alive.
    param = nn.Parameter(shard.clone(memory_format=torch.contiguous_format))
    param.tp_shard_dim = dim
    param.tp_num_chunks = num_chunks
    return param


def _replicated_param(full: Optional[torch.Tensor]) -> Optional[nn.Parameter]:
    return None if full is None else nn.Parameter(full.detach().clone())


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, group=None,
                           sequence_parallel: bool = False, gather_output: bool = False) -> torch.Tensor:
    """Y_r = X W_r^T + b_r, W_r this rank's rows of W. X is replicated, or with sequence
    parallelism this rank's sequence shard, gathered here. Also the tied LM head: W = the
    VocabParallelEmbedding's weight gives this rank's vocabulary slice of the logits."""
    y = linear_with_tensor_parallel_input(x, weight, bias, group, sequence_parallel)  # -> (s, b, out/tp)
    return gather_from_tensor_parallel_region(y, group) if gather_output else y  # -> (s, b, out)


class ColumnParallelLinear(nn.Module):
    """nn.Linear with the output features split across the TP group: rank r computes
    out_features / tp of them. Output (s, b, out/tp), or (s, b, out) with gather_output.
    With sequence_parallel the input is this rank's sequence shard (s/tp, b, in).
    num_fused > 1 splits each of num_fused equal output blocks separately (a fused QKV)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False, num_fused: int = 1, device=None, dtype=None):
        super().__init__()
        self.tp_size = dist.get_world_size(group)
        check_divisible(type(self).__name__, "out_features", out_features, self.tp_size, num_fused)
        if gather_output and num_fused > 1:
            raise ValueError(f"{type(self).__name__}: gather_output=True needs num_fused=1 (a gathered fused "
                             f"output would interleave the blocks rank by rank), got num_fused={num_fused}")
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.num_fused = num_fused
        self._load_full(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))

    def _load_full(self, linear: nn.Linear) -> None:
        self.weight = _sharded_param(linear.weight, 0, self.group, self.num_fused)  # (out/tp, in)
        self.bias = None if linear.bias is None else _sharded_param(linear.bias, 0, self.group, self.num_fused)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False, sequence_parallel: bool = False,
                    num_fused: int = 1) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                    sequence_parallel, num_fused, device="meta", dtype=linear.weight.dtype)
        layer._load_full(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                      self.gather_output)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (/{self.tp_size}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}, num_fused={self.num_fused}")


class RowParallelLinear(nn.Module):
    """nn.Linear with the input features split across the TP group: rank r multiplies its
    in_features / tp slice, the partial outputs are summed (all-reduce, or reduce-scatter along
    the sequence with sequence_parallel) and the bias is added once, after the sum.
    Input (s, b, in/tp), or (s, b, in) with input_is_parallel=False (sliced here)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.tp_size = dist.get_world_size(group)
        check_divisible(type(self).__name__, "in_features", in_features, self.tp_size)
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.group = group
        self.sequence_parallel = sequence_parallel
        self._load_full(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))

    def _load_full(self, linear: nn.Linear) -> None:
        self.weight = _sharded_param(linear.weight, 1, self.group)  # (out, in/tp)
        self.bias = _replicated_param(linear.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True,
                    sequence_parallel: bool = False) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                    sequence_parallel, device="meta", dtype=linear.weight.dtype)
        layer._load_full(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)  # nothing to reduce: keep the fused bias epilogue
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)  # (s, b, in) -> (s, b, in/tp)
        y = F.linear(x, self.weight)  # (s, b, in/tp) @ (in/tp, out) -> (s, b, out), a partial sum
        bias = self.bias
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)  # -> (s/tp, b, out)
            # The bias now meets only this rank's tokens: its grad is a partial sum.
            bias, = allreduce_grads_in_backward((bias,), self.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.group, inplace=True)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (/{self.tp_size}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with the vocabulary split across the TP group.

    The vocabulary is padded to a multiple of the TP size (`num_embeddings_padded`) with zero
    rows that no valid token reaches; rank r holds rows [vocab_start_index, vocab_end_index).
    Input (s, b) token ids; output (s, b, h), or this rank's sequence shard (s/tp, b, h) with
    sequence_parallel. Ids outside [0, num_embeddings) are not checked (that would cost a
    device sync) and embed to zeros.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        tp_rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.group = group
        self.sequence_parallel = sequence_parallel
        self._load_full(nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype))

    def _load_full(self, embedding: nn.Embedding) -> None:
        full = embedding.weight.detach()
        pad = full.new_zeros(self.num_embeddings_padded - self.num_embeddings, self.embedding_dim)
        self.weight = _sharded_param(torch.cat([full, pad]), 0, self.group)  # (V_padded/tp, h)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, sequence_parallel: bool = False
                       ) -> "VocabParallelEmbedding":
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding.from_embedding: padding_idx and max_norm are not supported, "
                             f"got padding_idx={embedding.padding_idx}, max_norm={embedding.max_norm}")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel,
                    device="meta", dtype=embedding.weight.dtype)
        layer._load_full(embedding)
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            y = F.embedding(tokens, self.weight)
        else:
            outside = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
            local = (tokens - self.vocab_start_index).masked_fill(outside, 0)
            # (s, b) -> (s, b, h): rows of this rank's tokens, zeros elsewhere; the sum over ranks is the lookup.
            y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.group)  # -> (s/tp, b, h)
        return reduce_from_tensor_parallel_region(y, self.group, inplace=True)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: (s, b, h) (or (s/tp, b, h) with sequence_parallel) -> this rank's
        vocabulary slice of the logits (s, b, V_padded/tp), for vocab_parallel_cross_entropy
        with vocab_size=self.num_embeddings (which masks the padding)."""
        return column_parallel_linear(hidden, self.weight, None, self.group, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.num_embeddings_padded}, /{self.tp_size}), "
                f"{self.embedding_dim}, sequence_parallel={self.sequence_parallel}")


class ParallelLayerNorm(nn.LayerNorm):
    """nn.LayerNorm replicated on every TP rank (same state_dict keys). With sequence_parallel it
    normalises this rank's sequence shard, and the grads of its weight and bias are summed over
    the TP group during backward (one collective), so they equal the unsharded grads."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.group = group
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm, group=None, sequence_parallel: bool = False) -> "ParallelLayerNorm":
        layer = cls(ln.normalized_shape, ln.eps, ln.elementwise_affine, ln.bias is not None, group,
                    sequence_parallel, device="meta")
        layer.weight = _replicated_param(ln.weight)
        layer.bias = _replicated_param(ln.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight, bias = allreduce_grads_in_backward((weight, bias), self.group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
