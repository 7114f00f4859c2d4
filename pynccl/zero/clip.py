"""Gradient clipping over sharded gradients: every rank holds a disjoint slice of every
gradient (padding is zero), so the global norm is one all-reduce of the local sums of
|g|^p (max for p = inf) away; the clip factor is then applied locally, exactly as
torch.nn.utils.clip_grad_norm_ computes it on the full gradients.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from ..comm import distributed as dist
from ..comm.reduce_op import ReduceOp


def clip_grad_norm_(shards: Iterable[torch.Tensor], max_norm: float, norm_type: float, group) -> torch.Tensor:
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a non-negative number, got {max_norm!r}")
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    shards = list(shards)
    grads = [p.grad for p in shards if p.grad is not None]
    device = shards[0].device
    with torch.no_grad():
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max().float() if grads else \
                torch.zeros((), device=device)
            total = local.reshape(1).clone()
            dist.all_reduce(total, op=ReduceOp.MAX, group=group)
            total = total[0]
        else:
            local = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type
                                 for g in grads]).sum() if grads else torch.zeros((), device=device)
            total = local.reshape(1).clone()
            dist.all_reduce(total, op=ReduceOp.SUM, group=group)
            total = total[0] ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total
