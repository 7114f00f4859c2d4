"""Mixed precision for ZeRO: compute in bf16/fp16 while the optimizer updates fp32 master
shards. The policy is data (which dtypes); the casts happen where data moves anyway: the
shard is cast into the all-gather buffer (flat_unit.gather) and gradients into the
reduce-scatter buffer (flat_unit.reduce_grad), so mixed precision adds no extra pass.

torch's policies are taken too, mapped field by field (check_policy): FSDP2's
MixedPrecisionPolicy (every field) and FSDP1's MixedPrecision (a field pynccl cannot honour,
buffer_dtype or keep_low_precision_grads=True, raises naming it).
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
    cast_forward_inputs: cast floating-point tensors passed to forward to param_dtype.
    output_dtype: cast floating-point tensors forward returns to it (None: leave them), as
    FSDP2's MixedPrecisionPolicy.output_dtype."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    output_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _COMPUTE_DTYPES:
                raise TypeError(f"MixedPrecision: {field} must be one of "
                                f"{', '.join(str(d) for d in _COMPUTE_DTYPES)} or None, got {value!r}")


def check_policy(mixed_precision) -> MixedPrecision:
    """pynccl's policy for `mixed_precision`: None, pynccl's MixedPrecision, or torch's FSDP2
    MixedPrecisionPolicy / FSDP1 MixedPrecision (torch.distributed.fsdp), mapped field by field."""
    if mixed_precision is None:
        return MixedPrecision()
    if isinstance(mixed_precision, MixedPrecision):
        return mixed_precision
    if type(mixed_precision).__module__.startswith("torch.distributed.fsdp"):
        from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision, MixedPrecisionPolicy
        if isinstance(mixed_precision, MixedPrecisionPolicy):
            return MixedPrecision(mixed_precision.param_dtype, mixed_precision.reduce_dtype,
                                  mixed_precision.cast_forward_inputs, mixed_precision.output_dtype)
        if isinstance(mixed_precision, TorchMixedPrecision):
            return _from_fsdp1(mixed_precision)
    raise TypeError(f"FullyShardedDataParallel: mixed_precision must be a pynccl.zero.MixedPrecision, torch's "
                    f"MixedPrecisionPolicy (FSDP2) or MixedPrecision (FSDP1), or None; got "
                    f"{type(mixed_precision).__name__}")


def _from_fsdp1(mp) -> MixedPrecision:
    """torch FSDP1's MixedPrecision. The pynccl wrapper is always the root FSDP instance, so its
    inputs are cast when torch would cast the root's (cast_root_forward_inputs, or
    cast_forward_inputs for every instance). _module_classes_to_ignore only acts with torch's
    auto_wrap_policy, which pynccl does not take: every parameter is cast."""
    if mp.buffer_dtype is not None:
        raise NotImplementedError(f"FullyShardedDataParallel: torch MixedPrecision.buffer_dtype={mp.buffer_dtype} "
                                  f"is not supported: pynccl keeps buffers in their own dtype (cast them with "
                                  f"module.to before wrapping, or pass buffer_dtype=None)")
    if mp.keep_low_precision_grads:
        raise NotImplementedError("FullyShardedDataParallel: torch MixedPrecision.keep_low_precision_grads=True is not "
                                  "supported: pynccl's gradients land in the master shards' dtype")
    return MixedPrecision(mp.param_dtype, mp.reduce_dtype, mp.cast_forward_inputs or mp.cast_root_forward_inputs)


def _cast_floats(tree, dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return pytree.tree_map(cast, tree)


def cast_inputs(policy: MixedPrecision, args: tuple, kwargs: dict):
    """(args, kwargs) with floating-point tensors cast to policy.param_dtype."""
    dtype = policy.param_dtype
    if dtype is None or not policy.cast_forward_inputs:
        return args, kwargs
    return _cast_floats(args, dtype), _cast_floats(kwargs, dtype)


def cast_outputs(policy: MixedPrecision, output):
    """forward's output with floating-point tensors cast to policy.output_dtype (if set)."""
    return output if policy.output_dtype is None else _cast_floats(output, policy.output_dtype)
