"""Tensor parallelism by plan on an unmodified model (Hugging Face or any nn.Module), mirroring
torch.distributed.tensor.parallel on plain tensors and pynccl groups, with no DTensor:

    model = parallelize_module(model, tp_group, {"model.layers.*.self_attn.q_proj": ColwiseParallel(), ...})

This file holds the machinery: layouts and the ParallelStyle interface; parallelize.py the entry
point, parallelize_module; styles.py and relayout.py the styles, loss_parallel.py the loss, plans.py ready plans. Each style shards the
matched module's parameters in place (same names, same module classes, so the model's own forward,
DDP, ZeRO and state_dict keep working) with the sharding code the Megatron-layout layers are built
with (sharding.py), and replaces its forward by the same functions as theirs (sharded_ops.py). Layouts say where a tensor is split: Shard(1) is the
sequence of Hugging Face's [b, s, h] (sequence parallelism), Shard(-1) the features, Replicate()
the whole tensor on every rank. torch's Shard / Replicate placements, torch's ParallelStyle
objects (torch_styles.py maps them field by field) and a 1-D torch DeviceMesh for the group are
accepted too, so a torch plan runs as written.
"""
from __future__ import annotations

import types
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import torch.nn as nn


GRAD_REDUCED_BY = "_pynccl_tp_grad_reduced_by"  # tensor attribute set by PrepareModuleInput
STYLE_ATTR = "_pynccl_tp_style"                  # module attribute: the style(s) applied to it
SHARD_SPECS_ATTR = "_pynccl_tp_shard_specs"       # root attribute: {param name: (dim, num_chunks)}


class Shard:
    """The tensor is split along `dim` across the TP group (rank order)."""

    def __init__(self, dim: int):
        self.dim = dim

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return dim is None or dim == self.dim

    def is_replicate(self) -> bool:
        return False

    def __repr__(self):
        return f"Shard({self.dim})"


class Replicate:
    """Every rank holds the whole tensor."""

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return True

    def __repr__(self):
        return "Replicate()"


def layout_of(value, what: str, allow_none: bool = False):
    """Ours or torch's placement (duck-typed: is_shard / is_replicate, .dim)."""
    if value is None and allow_none:
        return None
    if hasattr(value, "is_replicate") and value.is_replicate():
        return Replicate()
    if hasattr(value, "is_shard") and value.is_shard() and isinstance(getattr(value, "dim", None), int):
        return Shard(value.dim)
    raise ValueError(f"{what}: expected Shard(dim) or Replicate(), got {value!r}")


def is_sequence_dim(layout, ndim: int) -> bool:
    return layout.is_shard() and layout.dim % ndim != ndim - 1


class ParallelStyle:
    """How one module is parallelized. check() runs for every match before anything changes,
    so a size that does not divide leaves the model untouched; apply() changes the module."""

    def check(self, module: nn.Module, name: str, tp_size: int) -> None:
        pass

    def apply(self, module: nn.Module, name: str, group, sharded: Dict[int, nn.Parameter]) -> None:
        raise NotImplementedError


def install_shards(module: nn.Module, shards: Dict[str, nn.Parameter]) -> None:
    """Put each shard in place of the module's parameter of that name (same names, same module class)."""
    for attr, param in shards.items():
        module._parameters[attr] = param


def set_forward(module: nn.Module, style, forward) -> None:
    if getattr(module, STYLE_ATTR, None) is not None:
        raise ValueError(f"{type(module).__name__} already has a tensor-parallel forward "
                         f"({getattr(module, STYLE_ATTR)})")
    setattr(module, STYLE_ATTR, style)
    module.forward = types.MethodType(forward, module)


def grad_reduced_upstream(x, group) -> bool:
    """Whether a PrepareModuleInput over `group` made x and sums its grad (group is resolved, never None)."""
    return group is not None and getattr(x, GRAD_REDUCED_BY, None) is group


Plan = Mapping[str, Union[ParallelStyle, Sequence[ParallelStyle]]]


def shard_specs(module: nn.Module) -> Dict[str, Tuple[int, int]]:
    """{parameter name: (shard dim, fused blocks)} of a module returned by parallelize_module."""
    specs = getattr(module, SHARD_SPECS_ATTR, None)
    if specs is None:
        raise ValueError(f"{type(module).__name__} was not returned by parallelize_module")
    return specs
