"""Unsharded GPT-2-style modules (pre-LN), in the [s, b, h] layout of the tensor-parallel ones:
the reference the parallel modules are tested and benchmarked against, and a valid input to their
`from_module`. The math shared with them (attention, activation) is pynccl.tensor_parallel.functional,
so the two cannot drift apart.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tensor_parallel.functional import causal_attention, check_heads, gelu


class MLP(nn.Module):
    """fc -> GELU -> proj -> dropout. Input and output (s, b, h)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or 4 * hidden_size
        self.fc = nn.Linear(hidden_size, ffn_hidden_size, bias, device=device, dtype=dtype)
        self.proj = nn.Linear(ffn_hidden_size, hidden_size, bias, device=device, dtype=dtype)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(gelu(self.fc(x))), self.dropout, self.training)


class CausalSelfAttention(nn.Module):
    """Fused qkv projection ([q | k | v], GPT-2's c_attn) -> causal attention -> proj -> dropout."""

    def __init__(self, hidden_size: int, num_heads: int, bias: bool = True, attn_dropout: float = 0.0,
                 dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        check_heads(type(self).__name__, hidden_size, num_heads)
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias, device=device, dtype=dtype)
        self.proj = nn.Linear(hidden_size, hidden_size, bias, device=device, dtype=dtype)
        self.attn_dropout = attn_dropout
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = causal_attention(self.qkv(x), self.num_heads, self.attn_dropout if self.training else 0.0)
        return F.dropout(self.proj(y), self.dropout, self.training)


class TransformerBlock(nn.Module):
    """Pre-LN block: x + attn(ln1(x)); x + mlp(ln2(x)). Input and output (s, b, h)."""

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: Optional[int] = None, bias: bool = True,
                 dropout: float = 0.0, attn_dropout: float = 0.0, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden_size, eps, bias=bias, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(hidden_size, num_heads, bias, attn_dropout, dropout, device, dtype)
        self.ln2 = nn.LayerNorm(hidden_size, eps, bias=bias, device=device, dtype=dtype)
        self.mlp = MLP(hidden_size, ffn_hidden_size, bias, dropout, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
