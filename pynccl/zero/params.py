"""Bookkeeping of the wrapped module's original parameters: their names (tied ones keep every
name), their position in module.parameters() (the key of torch optimizer state dicts), and
the (module, attribute) places they are read from.

Sharding keeps each nn.Parameter object in its module's `_parameters` (so named_parameters()
and any optimizer built from it see it; its .data becomes this rank's rows, flat_unit.py) and
puts the tensor forward must read (the gathered full parameter) in the module's instance
__dict__ under the same name: attribute lookup finds the instance __dict__ before
nn.Module.__getattr__ consults `_parameters`, so the module's code runs unchanged.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn


class ParamInfo:
    """One original parameter (shared parameters appear once, with all their names)."""

    __slots__ = ("index", "name", "names", "owners", "shape", "dtype", "requires_grad", "frozen_master",
                 "location", "param")

    def __init__(self, index: int, name: str, owner: Tuple[nn.Module, str], p: torch.Tensor):
        self.index = index                 # position in the original module.parameters()
        self.name = name                   # first fully qualified name
        self.names = [name]
        self.owners = [owner]
        self.shape = p.shape
        self.dtype = p.dtype
        self.requires_grad = p.requires_grad
        self.frozen_master: Optional[torch.Tensor] = None   # full tensor of a requires_grad=False param
        self.location: Optional[Tuple[int, int]] = None     # (unit index, slot index) once sharded
        self.param = p                     # the nn.Parameter object itself (stays in the module)


def collect_params(module: nn.Module) -> Tuple[List[ParamInfo], List[torch.Tensor]]:
    """ParamInfos in module.parameters() order, and the parameter tensors themselves."""
    infos: Dict[int, ParamInfo] = {}
    order: List[ParamInfo] = []
    tensors: List[torch.Tensor] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            info = infos.get(id(p))
            if info is None:
                info = ParamInfo(len(order), fqn, (mod, attr), p)
                infos[id(p)] = info
                order.append(info)
                tensors.append(p)
                continue
            if fqn not in info.names:
                info.names.append(fqn)
            if not any(m is mod and a == attr for m, a in info.owners):
                info.owners.append((mod, attr))
    return order, tensors


def install(info: ParamInfo, tensor: torch.Tensor) -> None:
    """Make every module that owns `info` read `tensor` under the parameter's attribute name
    (shadowing the nn.Parameter, which stays in `_parameters`)."""
    for mod, attr in info.owners:
        mod.__dict__[attr] = tensor


def named_buffers_all(module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """Persistent buffers with their names, as module.state_dict() would list them."""
    out = []
    for mod_name, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out
