"""pynccl.SyncBatchNorm: batch statistics over every rank of a pynccl group, so a per-rank
micro-batch normalises as the full batch would. One all-reduce in forward (per-channel count,
mean and spread, combined as Chan et al. do, in float64 so large means do not cancel) and one in
backward (sum of dy and of dy*(x-mean)). Runs on gloo (CPU) and nccl alike; world size 1 and
eval mode fall back to F.batch_norm, as torch.nn.SyncBatchNorm does.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import distributed as dist
from ..comm.groups import resolve_group
from ..comm.reduce_op import ReduceOp


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        num_channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, num_channels] + [1] * (x.dim() - 2)
        xf = x.float()
        local_n = x.numel() // num_channels
        local_var, local_mean = torch.var_mean(xf, dim=dims, unbiased=False)        # (C,), (C,)
        # Per rank: n*mean, n*var + n*mean^2 (= sum x^2), n; summed over ranks in float64.
        stats = torch.cat([local_mean.double() * local_n,
                           local_var.double() * local_n + local_mean.double().square() * local_n,
                           torch.full((1,), float(local_n), dtype=torch.float64, device=x.device)])
        dist.all_reduce(stats, ReduceOp.SUM, group=group)
        sum_x, sum_x2, count = stats[:num_channels], stats[num_channels:2 * num_channels], stats[-1]
        mean64 = sum_x / count
        var64 = (sum_x2 / count - mean64.square()).clamp_min(0)
        mean, var = mean64.float(), var64.float()
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var64 * count / (count - 1).clamp_min(1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.float().view(shape) + bias.float().view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count = count
        ctx.group = group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        dyf = dy.float()
        xmu = x.float() - mean.view(shape)
        sum_dy = dyf.sum(dims)                                       # (C,)
        sum_dy_xmu = (dyf * xmu).sum(dims)                           # (C,)
        # NOTE: weight/bias grads stay local sums (DDP averages them), as in torch's SyncBatchNorm.
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(both, ReduceOp.SUM, group=ctx.group)
            count = ctx.count.float()
            mean_dy = (both[: x.shape[1]] / count).view(shape)
            mean_dy_xmu = (both[x.shape[1]:] / count).view(shape)
            scale = invstd if weight is None else invstd * weight.float()
            grad_x = ((dyf - mean_dy - xmu * invstd.square().view(shape) * mean_dy_xmu)
                      * scale.view(shape)).to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """torch.nn.SyncBatchNorm's arguments; `process_group` is a pynccl ProcessGroup or None."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        # A torch.distributed group is mapped to pynccl's (resolve_group); TypeError for anything else.
        self.process_group = None if process_group is None else resolve_group(process_group)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (N, C, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: input has {input.shape[1]} channels, expected {self.num_features}")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None
        world_size = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        if not (bn_training and self.training and world_size > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps)
        if input.numel() // input.shape[1] < 1:
            raise ValueError(f"SyncBatchNorm: expected at least one value per channel, got input of shape "
                             f"{tuple(input.shape)}")
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var, self.eps, factor,
                                      self.process_group)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Replace every BatchNorm*d in `module` by a SyncBatchNorm holding the same state."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      process_group)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out
