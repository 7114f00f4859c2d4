"""The math the tensor-parallel GPT block shares with its unsharded reference
(pynccl.testing.reference_models): GPT-2's activation and causal attention over packed qkv, so a
sharded block and the unsharded one compute the same function by construction.
"""
from __future__ import annotations

import torch
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
