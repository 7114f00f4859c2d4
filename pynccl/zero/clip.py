"""Global-norm gradient clipping that knows which tensors are ZeRO shards.

A sharded parameter (ShardedUnit marks it with its group) holds a disjoint slice of the full
gradient on each rank of that group, so the global norm is one all-reduce of the local sums
of |g|^p (max for p = inf) away; any other tensor is taken as replicated (equal on every
rank, as DDP's are) and counted once, locally. The clip factor is then applied everywhere,
exactly as torch.nn.utils.clip_grad_norm_ computes it on the full gradients. That torch
function itself, called on ZeRO parameters, would see only the local slices and clip each
rank by a different, wrong norm: call this one instead.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Union

import torch

from ..comm import distributed as dist
from ..comm.reduce_op import ReduceOp


def _local_stat(grads: List[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """max |g| (p = inf) or sum |g|^p over `grads`, as a float32 scalar on `device`."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return torch.stack([g.abs().max().float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                            for g in grads]).max()
    return torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type
                        for g in grads]).sum()


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over ZeRO-sharded and plain parameters: scales every
    gradient so that the global norm is at most max_norm and returns that norm (before
    clipping). Collective over the group of every sharded parameter given (same call on every
    rank of it). error_if_nonfinite: raise RuntimeError if the norm is nan or inf."""
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a non-negative number, got {max_norm!r}")
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not params:
        return torch.zeros(())
    device = params[0].device
    plain: List[torch.Tensor] = []
    sharded: Dict[int, list] = {}                      # id(group) -> [group, grads]
    for p in params:
        if p.grad is None:
            continue
        group = getattr(p, "_pynccl_zero_group", None)
        if group is None:
            plain.append(p.grad)
        else:
            sharded.setdefault(id(group), [group, []])[1].append(p.grad)
    inf = math.isinf(norm_type)
    with torch.no_grad():
        total = _local_stat(plain, norm_type, device)
        # NOTE: one scalar all-reduce per group, in the order the groups first appear in
        # `parameters`: the same on every rank when every rank passes its parameters in the same order.
        for group, grads in sharded.values():
            part = _local_stat(grads, norm_type, device).reshape(1).clone()
            dist.all_reduce(part, op=ReduceOp.MAX if inf else ReduceOp.SUM, group=group)
            total = torch.maximum(total, part[0]) if inf else total + part[0]
        if not inf:
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {float(total)}; "
                               f"pass error_if_nonfinite=False to clip anyway")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in plain + [g for _, grads in sharded.values() for g in grads]:
            g.mul_(coef.to(g.dtype))
    return total
