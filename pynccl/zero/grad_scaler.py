"""ShardedGradScaler: torch.amp.GradScaler for a ZeRO-sharded model (fp16 loss scaling).

A plain GradScaler checks each rank's own gradients for inf/NaN; under ZeRO those are only the
rank's shard, so an overflow in one rank's rows makes that rank skip the step and back off its
scale while the others step: the replicas diverge, silently. This one combines the ranks'
verdicts (an all-reduce with MAX over each ZeRO group the optimizer's parameters belong to,
as torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler does), so every rank skips or
steps alike. It hooks GradScaler._unscale_grads_, which both unscale_() and the fused
optimizers' path (Adam(fused=True) checks infs without unscaling) go through.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..comm import distributed as dist
from ..comm.reduce_op import ReduceOp


class ShardedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose inf/NaN check covers every rank's gradient shards. Same
    arguments as GradScaler, plus process_group: the group to agree over (default: the ZeRO
    groups of the optimizer's parameters; parameters of no ZeRO model are checked locally).
    Collective in unscale_() and step(): every rank calls them, in the same order."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None):
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group

    def _groups_of(self, optimizer: torch.optim.Optimizer) -> List[object]:
        if self.process_group is not None:
            return [self.process_group]
        groups: Dict[int, object] = {}                 # in param_groups order: the same on every rank
        for g in optimizer.param_groups:
            for p in g["params"]:
                group = getattr(p, "_pynccl_zero_group", None)
                if group is not None and group.world_size > 1:
                    groups.setdefault(id(group), group)
        return list(groups.values())

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        groups = self._groups_of(optimizer)
        if not groups:
            return per_device
        # NOTE: one all-reduce per group whatever this rank's gradients are (none at all included),
        # so the collectives match on every rank.
        device = found_inf.device
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for t in per_device.values():
            flag = torch.maximum(flag, t.reshape(1).to(device))
        for group in groups:
            dist.all_reduce(flag, op=ReduceOp.MAX, group=group)
        for t in per_device.values():
            t.copy_(flag.reshape(t.shape))
        if not per_device:
            per_device[device] = flag.reshape(found_inf.shape)
        return per_device

