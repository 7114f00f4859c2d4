"""Tensor-parallel MLP, causal self-attention and pre-LN transformer block (Megatron,
arXiv:1909.08053 §3; sequence parallelism arXiv:2205.05198 §4.2).

Each is a column-parallel layer followed by a row-parallel one, so one block costs two
all-reduces forward and two backward. With sequence parallelism each sublayer costs an
all-gather and a reduce-scatter forward, and backward an all-gather (row), a reduce-scatter
(column) and the all-gather that rebuilds the column layer's input instead of storing it, plus
one small all-reduce of replicated-parameter grads per LayerNorm and row bias. Names match the
unsharded reference modules (pynccl.testing.reference_models), so sharded state_dicts have the
same keys; `from_module` takes any module with those names.
Layout [s, b, h]; with sequence_parallel every input and output is this rank's (s/tp, b, h).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..comm import distributed as dist
from .functional import causal_attention, check_heads, gelu
from .layers import ColumnParallelLinear, ParallelLayerNorm, RowParallelLinear
from .random import dropout, sharded_rng
from .sharding import check_divisible


class ParallelMLP(nn.Module):
    """fc (column-parallel) -> GELU -> proj (row-parallel) -> dropout; each rank holds
    ffn_hidden_size / tp of the hidden units."""

    def __init__(self, hidden_size: int, ffn_hidden_size: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        check_divisible(type(self).__name__, "ffn_hidden_size", ffn_hidden_size, dist.get_world_size(group))
        self.fc = ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, group=group,
                                       sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.proj = RowParallelLinear(ffn_hidden_size, hidden_size, bias, group=group,
                                      sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.dropout = dropout
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_module(cls, mlp: nn.Module, group=None, sequence_parallel: bool = False) -> "ParallelMLP":
        layer = cls(mlp.fc.in_features, mlp.fc.out_features, mlp.fc.bias is not None, mlp.dropout, group,
                    sequence_parallel, device="meta")
        layer.fc = ColumnParallelLinear.from_linear(mlp.fc, group, sequence_parallel=sequence_parallel)
        layer.proj = RowParallelLinear.from_linear(mlp.proj, group, sequence_parallel=sequence_parallel)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(gelu(self.fc(x)))  # (s, b, h) -> (s, b, ffn/tp) -> (s, b, h)
        # Sequence-parallel output is sharded: each rank must draw its own mask.
        return dropout(y, self.dropout, self.training, sharded=self.sequence_parallel)


class ParallelCausalSelfAttention(nn.Module):
    """Heads split across the TP group: rank r computes num_heads / tp heads end to end (its
    q, k, v columns of the fused qkv projection, attention, its rows of proj)."""

    def __init__(self, hidden_size: int, num_heads: int, bias: bool = True, attn_dropout: float = 0.0,
                 dropout: float = 0.0, group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        tp_size = dist.get_world_size(group)
        check_heads(name, hidden_size, num_heads)
        check_divisible(name, "num_heads", num_heads, tp_size)
        self.num_heads = num_heads
        self.num_heads_per_partition = num_heads // tp_size
        self.qkv = ColumnParallelLinear(hidden_size, 3 * hidden_size, bias, group=group,
                                        sequence_parallel=sequence_parallel, num_fused=3, device=device, dtype=dtype)
        self.proj = RowParallelLinear(hidden_size, hidden_size, bias, group=group,
                                      sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.attn_dropout = attn_dropout
        self.dropout = dropout
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_module(cls, attn: nn.Module, group=None,
                    sequence_parallel: bool = False) -> "ParallelCausalSelfAttention":
        layer = cls(attn.proj.in_features, attn.num_heads, attn.qkv.bias is not None, attn.attn_dropout,
                    attn.dropout, group, sequence_parallel, device="meta")
        layer.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, sequence_parallel=sequence_parallel,
                                                     num_fused=3)
        layer.proj = RowParallelLinear.from_linear(attn.proj, group, sequence_parallel=sequence_parallel)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (s, b, h) -> (s, b, 3h/tp): [q | k | v] of this rank's heads
        p = self.attn_dropout if self.training else 0.0
        with sharded_rng(p > 0.0, x.device):  # heads are sharded: per-rank attention masks
            y = causal_attention(qkv, self.num_heads_per_partition, p)  # -> (s, b, h/tp)
        y = self.proj(y)  # (s, b, h/tp) -> (s, b, h), summed over every rank's heads
        return dropout(y, self.dropout, self.training, sharded=self.sequence_parallel)


class ParallelTransformerBlock(nn.Module):
    """Pre-LN block (x + attn(ln1(x)); x + mlp(ln2(x))) with replicated LayerNorms and
    tensor-parallel attention and MLP. Built from sizes, it equals reference_models.TransformerBlock
    built from the same sizes under the same RNG state, sharded."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, attn_dropout: float = 0.0, eps: float = 1e-5, group=None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        # NOTE: same creation order as reference_models.TransformerBlock, so both draw the same initial weights.
        self.ln1 = ParallelLayerNorm(hidden_size, eps, bias=bias, group=group, sequence_parallel=sequence_parallel,
                                     device=device, dtype=dtype)
        self.attn = ParallelCausalSelfAttention(hidden_size, num_heads, bias, attn_dropout, dropout, group,
                                                sequence_parallel, device, dtype)
        self.ln2 = ParallelLayerNorm(hidden_size, eps, bias=bias, group=group, sequence_parallel=sequence_parallel,
                                     device=device, dtype=dtype)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size, bias, dropout, group, sequence_parallel, device, dtype)
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_module(cls, block: nn.Module, group=None,
                    sequence_parallel: bool = False) -> "ParallelTransformerBlock":
        attn, mlp = block.attn, block.mlp
        layer = cls(attn.proj.in_features, attn.num_heads, mlp.fc.out_features, attn.qkv.bias is not None,
                    mlp.dropout, attn.attn_dropout, block.ln1.eps, group, sequence_parallel, device="meta")
        layer.ln1 = ParallelLayerNorm.from_layernorm(block.ln1, group, sequence_parallel)
        layer.attn = ParallelCausalSelfAttention.from_module(attn, group, sequence_parallel)
        layer.ln2 = ParallelLayerNorm.from_layernorm(block.ln2, group, sequence_parallel)
        layer.mlp = ParallelMLP.from_module(mlp, group, sequence_parallel)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (s, b, h), or (s/tp, b, h) with sequence parallelism
        return x + self.mlp(self.ln2(x))
