"""parallelize_module, torch.distributed.tensor.parallel's entry point: match a plan's glob
patterns to submodules, map torch's own styles onto pynccl's (torch_styles.py), check every size
before anything changes, optionally broadcast the weights from one rank, then apply each style
(styles.py on plan.py's machinery). Kept apart from plan.py so that the styles, which build on the
machinery, and the torch mapping, which builds on the styles, import in one direction."""
from __future__ import annotations

import fnmatch
import warnings
from typing import Dict, Optional, Union

import torch
import torch.nn as nn

from ..comm import distributed as dist
from ..comm.coalesced import coalesced_broadcaster
from ..comm.groups import resolve_group
from .plan import SHARD_SPECS_ATTR, ParallelStyle, Plan
from .torch_styles import from_torch_style, is_torch_style


def _matches(pattern: str, name: str) -> bool:
    """Glob per dotted atom, as torch's parallelize_module: 'layers.*.mlp' matches 'layers.3.mlp'
    but not 'layers.3.block.mlp'. The empty pattern is the root module."""
    if pattern == "" or name == "":
        return pattern == name
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def parallelize_module(module: nn.Module, device_mesh=None, parallelize_plan: Union[Plan, ParallelStyle, None] = None,
                       *, src_data_rank: Optional[int] = 0) -> nn.Module:
    """torch's parallelize_module on plain tensors: apply `parallelize_plan` ({glob pattern of
    submodule names: style or tuple of styles}, or one style for `module` itself; pynccl's styles
    or torch's) over the TP group `device_mesh`: a pynccl ProcessGroup, a torch ProcessGroup or a
    1-D torch DeviceMesh (None: the default group). Collective in effect: every rank of the group
    must apply the same plan. src_data_rank (as torch's): the group rank whose weights every rank
    shards (they are broadcast from it first); None: each rank shards its own. Modifies `module`
    in place and returns it. Raises ValueError, before changing anything, for a size that does not
    divide. Patterns matching no module are reported with a warning (a pipeline stage may lack some)."""
    plan = {} if parallelize_plan is None else parallelize_plan
    if isinstance(plan, ParallelStyle) or is_torch_style(plan):
        plan = {"": plan}
    if getattr(module, SHARD_SPECS_ATTR, None) is not None:
        raise ValueError(f"parallelize_module: {type(module).__name__} is already tensor-parallel")
    # styles compare groups by identity: the resolved pynccl group
    tp_group = dist.get_default_group() if device_mesh is None else resolve_group(device_mesh)
    tp_size = dist.get_world_size(tp_group)
    named = list(module.named_modules())
    work = []
    for pattern, styles in plan.items():
        styles = tuple(styles) if isinstance(styles, (tuple, list)) else (styles,)
        styles = tuple(mapped for style in styles
                       for mapped in (from_torch_style(style, pattern) if is_torch_style(style) else (style,)))
        for style in styles:
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"parallelize_module: plan[{pattern!r}] must be a ParallelStyle, got {style!r}")
        hits = [(name, mod) for name, mod in named if _matches(pattern, name)]
        if not hits:
            warnings.warn(f"parallelize_module: plan key {pattern!r} matches no submodule of {type(module).__name__}")
        work += [(name, mod, style) for name, mod in hits for style in styles]
    for name, mod, style in work:
        style.check(mod, name, tp_size)
    if tp_size > 1 and src_data_rank is not None:
        _broadcast_weights([mod for _, mod, _ in work], tp_group, src_data_rank)
    sharded: Dict[int, nn.Parameter] = {}
    for name, mod, style in sorted(work, key=lambda w: w[0] == ""):  # root styles (the loss) last
        if tp_size > 1:  # at TP 1 every style is the identity
            style.apply(mod, name, tp_group, sharded)
    specs = {name: (p.tp_shard_dim, p.tp_num_chunks) for name, p in module.named_parameters(remove_duplicate=False)
             if getattr(p, "tp_shard_dim", None) is not None}
    setattr(module, SHARD_SPECS_ATTR, specs)
    return module


def _broadcast_weights(modules, group, src_data_rank: int) -> None:
    """Every rank's weights of the planned modules become group rank `src_data_rank`'s, as torch's
    distribute_tensor(src_data_rank=...) makes them (one coalesced broadcast per dtype)."""
    if not isinstance(src_data_rank, int) or not 0 <= src_data_rank < group.world_size:
        raise ValueError(f"parallelize_module: src_data_rank must be a rank of the TP group (0..{group.world_size - 1}) "
                         f"or None, got {src_data_rank!r}")
    params = list({id(p): p for mod in modules for p in mod.parameters()}.values())
    device = group.backend.device
    on_device = [p.detach().to(device) for p in params]   # the parameter itself where it is on `device`
    with torch.no_grad():
        coalesced_broadcaster(on_device)(group.backend, src_data_rank)
        for p, t in zip(params, on_device):
            if p.device != device:
                p.copy_(t)
