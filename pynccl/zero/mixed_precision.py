"""Mixed precision for ZeRO: compute in bf16/fp16 while the optimizer updates fp32 master
shards. The policy is data (which dtypes); the casts happen where data moves anyway: the
shard is cast into the all-gather buffer (flat_unit.gather) and gradients into the
reduce-scatter buffer (flat_unit.reduce_grad), so mixed precision adds no extra pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils._pytree as pytree

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """param_dtype: dtype of the gathered parameters used in forward/backward (master shards stay
    in the parameters' own dtype, usually fp32). reduce_dtype: dtype gradients are averaged in
    (None: param_dtype; torch.float32 for exact sums at twice the traffic).
    cast_forward_inputs: cast floating-point tensors passed to forward to param_dtype."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _COMPUTE_DTYPES:
                raise TypeError(f"MixedPrecision: {field} must be one of "
                                f"{', '.join(str(d) for d in _COMPUTE_DTYPES)} or None, got {value!r}")


def check_policy(mixed_precision) -> MixedPrecision:
    if mixed_precision is None:
        return MixedPrecision()
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"FullyShardedDataParallel: mixed_precision must be a pynccl.zero.MixedPrecision or None, "
                        f"got {type(mixed_precision).__name__}")
    return mixed_precision


def cast_inputs(policy: MixedPrecision, args: tuple, kwargs: dict):
    """(args, kwargs) with floating-point tensors cast to policy.param_dtype."""
    dtype = policy.param_dtype
    if dtype is None or not policy.cast_forward_inputs:
        return args, kwargs

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)
