"""Unsharded GPT-2-style modules (pre-LN), in the [s, b, h] layout of the tensor-parallel ones:
the reference the parallel modules are tested against and built from (`from_module`). The math
shared by both (attention, activation) lives here once, so they cannot drift apart.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # GPT-2's "gelu_new"


def causal_attention(qkv: torch.Tensor, num_heads: int, dropout_p: float = 0.0) -> torch.Tensor:
    """(s, b, 3·nh·hd) packed [q | k | v] -> (s, b, nh·hd): causal softmax attention per head."""
    s, b, three_h = qkv.shape
    h = three_h // 3
    # each (s, b, nh·hd) -> (b, nh, s, hd)
    q, k, v = (t.view(s, b, num_heads, h // num_heads).permute(1, 2, 0, 3) for t in qkv.split(h, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (b, nh, s, hd)
    return y.permute(2, 0, 1, 3).reshape(s, b, h)  # (s, b, nh·hd)


def check_heads(layer: str, hidden_size: int, num_heads: int) -> None:
    if num_heads <= 0 or hidden_size % num_heads:
        raise ValueError(f"{layer}: hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")


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
