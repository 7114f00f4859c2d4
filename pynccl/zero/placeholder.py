"""What a module attribute of a ZeRO-3 sharded parameter holds outside its unit's forward: a tensor
with the parameter's shape, dtype, device and requires_grad and no data, on which any op raises
ShardedParameterError naming the parameter; an empty tensor there let reads return silently wrong values.

A wrapper subclass (torch.Tensor._make_wrapper_subclass) allocates nothing; one per parameter is
made at wrap time, so the free after each unit's forward only puts it back (stage3.py).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import ShardedParameterError

_T = torch.Tensor
# NOTE: what may run on a placeholder: metadata that reads no values. Everything else raises in
# __torch_function__, before autograd (which would otherwise report an in-place op on a leaf that
# requires grad) and before conversions that never reach aten (tolist, numpy); __torch_dispatch__
# raises for what reaches aten some other way.
_METADATA = frozenset(
    [getattr(_T, name).__get__ for name in ("shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "grad",
                                            "grad_fn", "ndim", "itemsize", "nbytes", "is_cuda", "is_cpu", "is_meta",
                                            "is_sparse", "is_quantized", "is_nested")]
    + [getattr(_T, name) for name in ("size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
                                      "is_floating_point", "is_complex", "element_size", "get_device", "__len__",
                                      "__format__")])


class ShardedParamPlaceholder(torch.Tensor):
    """Stands for the ZeRO-3 sharded parameter `names[0]` where its unit (`unit`: words naming
    it) is not gathered. Holds no data: its shape, dtype, device and requires_grad are the
    parameter's; any op raises ShardedParameterError."""

    @staticmethod
    def __new__(cls, names, unit: str, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                requires_grad: bool):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t.param_names = tuple(names)
        t.unit = unit
        return t

    def __repr__(self) -> str:
        return (f"ShardedParamPlaceholder('{self.param_names[0]}', shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, requires_grad={self.requires_grad}: sharded by ZeRO-3, no values here)")

    def _error(self, op) -> ShardedParameterError:
        name = self.param_names[0]
        tied = f" (tied: also {', '.join(repr(n) for n in self.param_names[1:])})" if len(self.param_names) > 1 else ""
        op_name = getattr(op, "__name__", None) or str(op)
        return ShardedParameterError(
            f"'{name}'{tied} is sharded by ZeRO-3 (FullyShardedDataParallel(stage=3)) and was used outside the "
            f"forward of its unit ({self.unit}): there the module attribute holds no values, only the parameter's "
            f"shape {list(self.shape)}, dtype {self.dtype} and device {self.device}, and {op_name} needs its values. "
            f"Use it inside the forward of a module of that unit (make the module that uses it part of the unit: "
            f"wrap_modules=), or get the full values from model.full_state_dict() (collective; also model.state_dict() "
            f"after FullyShardedDataParallel.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)).")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise _error_naming(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _error_naming(func, args, kwargs or {})


def _error_naming(func, args, kwargs) -> ShardedParameterError:
    """The error naming the first placeholder among `func`'s arguments."""
    found = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, ShardedParamPlaceholder)), None)
    if found is None:                                  # held where pytree does not look
        return ShardedParameterError(f"{func}: an argument is a ZeRO-3 sharded parameter outside the forward of its "
                                     f"unit, which holds no values; read it inside that forward")
    return found._error(func)


def make_placeholders(unit_module: Optional[nn.Module], infos, device: torch.device) -> List[ShardedParamPlaceholder]:
    """One placeholder per parameter (params.ParamInfo) of the unit of `unit_module` (None: the root unit)."""
    unit = ("the root unit, gathered only during a call of the wrapped module: the FullyShardedDataParallel "
            "forward, model.module(...), generate()") if unit_module is None else _unit_name(unit_module, infos[0])
    return [ShardedParamPlaceholder(i.names, unit, i.shape, i.dtype, device, i.requires_grad) for i in infos]


def _unit_name(unit_module: nn.Module, info) -> str:
    """'blocks.0' (Block): the unit module's name, what remains of a member's name without its path inside the unit."""
    owner, attr = info.owners[0]                       # the module of info.name, its first name
    owner_name = info.name[:-len(attr)].rstrip(".")
    for inner, sub in unit_module.named_modules(remove_duplicate=False):
        if sub is not owner or (inner and not owner_name.endswith("." + inner)):
            continue
        name = owner_name[:-len(inner) - 1] if inner else owner_name
        if name:
            return f"'{name}' ({type(unit_module).__name__})"
    return f"a {type(unit_module).__name__} module"
