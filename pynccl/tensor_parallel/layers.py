"""Sharded nn.Linear, nn.Embedding and a TP-aware LayerNorm as modules of their own (Megatron,
arXiv:1909.08053 §3), for models written tensor-parallel. They are thin: the shards come from
sharding.py and the forward from sharded_ops.py, the same code the plan's styles (styles.py) apply
to an unmodified model's own layers. Layout: [s, b, h] by default (Megatron: sequence first, so a
sequence shard is one contiguous slab); `sequence_dim=1` takes Hugging Face's [b, s, h].

Each layer can be built two ways that give the same weights: from its sizes (the unsharded torch
layer is built, as it would be under the same RNG state, then cut, so a model starts the same at
every TP size), or from an existing torch layer (`from_linear`, ...), taking its slice.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import distributed as dist
from .comm import allreduce_grads_in_backward
from .sharded_ops import column_parallel_linear, row_parallel_linear, vocab_parallel_embedding
from .sharding import check_divisible, column_shards, row_shards, shard_parameter


def _replicated_param(full: Optional[torch.Tensor]) -> Optional[nn.Parameter]:
    return None if full is None else nn.Parameter(full.detach().clone())


class ColumnParallelLinear(nn.Module):
    """nn.Linear with the output features split across the TP group: rank r computes
    out_features / tp of them. Output (s, b, out/tp), or (s, b, out) with gather_output.
    With sequence_parallel the input is this rank's sequence shard (s/tp, b, in).
    num_fused > 1 splits each of num_fused equal output blocks separately (a fused QKV)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False, num_fused: int = 1, device=None, dtype=None, *,
                 sequence_dim: int = 0):
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
        self.sequence_dim = sequence_dim
        self.num_fused = num_fused
        self._load_full(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))

    def _load_full(self, linear: nn.Linear) -> None:
        shards = column_shards(linear, self.group, self.num_fused)
        self.weight = shards["weight"]  # (out/tp, in)
        self.bias = shards.get("bias")

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False, sequence_parallel: bool = False,
                    num_fused: int = 1, *, sequence_dim: int = 0) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                    sequence_parallel, num_fused, device="meta", dtype=linear.weight.dtype, sequence_dim=sequence_dim)
        layer._load_full(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                                      self.gather_output, self.sequence_dim)

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
                 group=None, sequence_parallel: bool = False, device=None, dtype=None, *, sequence_dim: int = 0):
        super().__init__()
        self.tp_size = dist.get_world_size(group)
        check_divisible(type(self).__name__, "in_features", in_features, self.tp_size)
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self._load_full(nn.Linear(in_features, out_features, bias, device=device, dtype=dtype))

    def _load_full(self, linear: nn.Linear) -> None:
        self.weight = row_shards(linear, self.group)["weight"]  # (out, in/tp)
        self.bias = _replicated_param(linear.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True,
                    sequence_parallel: bool = False, *, sequence_dim: int = 0) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                    sequence_parallel, device="meta", dtype=linear.weight.dtype, sequence_dim=sequence_dim)
        layer._load_full(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (s, b, in/tp) -> (s, b, out), or this rank's (s/tp, b, out) with sequence parallelism
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.input_is_parallel,
                                   self.sequence_parallel, self.sequence_dim)

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
                 device=None, dtype=None, *, sequence_dim: int = 0):
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
        self.sequence_dim = sequence_dim
        self._load_full(nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype))

    def _load_full(self, embedding: nn.Embedding) -> None:
        full = embedding.weight
        pad = full.new_zeros(self.num_embeddings_padded - self.num_embeddings, self.embedding_dim)
        # the vocabulary rows, as RowwiseParallel cuts an nn.Embedding (sharding.row_shards)
        self.weight = shard_parameter(torch.cat([full.detach(), pad]), 0, self.group,
                                      requires_grad=full.requires_grad)  # (V_padded/tp, h)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, sequence_parallel: bool = False, *,
                       sequence_dim: int = 0) -> "VocabParallelEmbedding":
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding.from_embedding: padding_idx and max_norm are not supported, "
                             f"got padding_idx={embedding.padding_idx}, max_norm={embedding.max_norm}")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel,
                    device="meta", dtype=embedding.weight.dtype, sequence_dim=sequence_dim)
        layer._load_full(embedding)
        return layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # (s, b) -> (s, b, h), or this rank's (s/tp, b, h) with sequence parallelism
        return vocab_parallel_embedding(tokens, self.weight, self.vocab_start_index, self.group, None,
                                        self.sequence_parallel, self.sequence_dim)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: (s, b, h) (or (s/tp, b, h) with sequence_parallel) -> this rank's
        vocabulary slice of the logits (s, b, V_padded/tp), for vocab_parallel_cross_entropy
        with vocab_size=self.num_embeddings (which masks the padding)."""
        return column_parallel_linear(hidden, self.weight, None, self.group, self.sequence_parallel,
                                      seq_dim=self.sequence_dim)

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
