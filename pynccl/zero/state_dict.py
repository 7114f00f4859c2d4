"""Full (consolidated) state dicts of a sharded model and its optimizer, and loading them back.

The full forms are exactly what an unwrapped model and a plain torch optimizer produce:
model keys are the original parameter/buffer names (tied parameters under every name);
optimizer state is keyed by position in the original module.parameters(). So a
checkpoint moves freely between a plain run and ZeRO runs of any world size and stage:
loading only cuts each rank's slice out of the full tensors (FlatLayout.shard_from_params).

Per-element optimizer state (Adam's exp_avg, SGD's momentum_buffer, ...) is recognised
by its shape: the shard's shape when sharded, the parameter's when full; anything else
(step counters, None) is per tensor and copied to every parameter of the unit.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import torch

from ..comm import distributed as dist
from .layout import FlatLayout
from .params import install, named_buffers_all


def _cpu_clone(v):
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def is_sharded_value(v, layout: FlatLayout) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == layout.shard_numel


def is_full_value(key: str, v, shape: torch.Size) -> bool:
    return isinstance(v, torch.Tensor) and v.shape == shape and not (v.dim() == 0 and key == "step")


def split_flat(layout: FlatLayout, flat: torch.Tensor) -> Dict[int, torch.Tensor]:
    """Full flat (padded_numel,) -> {param_index: parameter-shaped CPU tensor}."""
    return {s.param_index: _cpu_clone(v) for s, v in zip(layout.slots, layout.views(flat))}


def unflatten_state(layout: FlatLayout, state: dict, gather_full: Callable[[str, torch.Tensor], torch.Tensor]):
    """One shard's optimizer state -> {param_index: state of the original parameter}.
    gather_full(key, shard_value) returns the full flat value of a per-element entry."""
    out = {s.param_index: {} for s in layout.slots}
    for key, v in state.items():
        if is_sharded_value(v, layout):
            for idx, t in split_flat(layout, gather_full(key, v)).items():
                out[idx][key] = t
        else:
            for idx in out:
                out[idx][key] = _cpu_clone(v)
    return out


def full_groups(groups: List[dict], layouts_per_group: List[List[FlatLayout]]) -> List[dict]:
    """Optimizer param_groups with the shards replaced by their original parameters' positions."""
    return [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
             "params": sorted(s.param_index for lay in lays for s in lay.slots)}
            for g, lays in zip(groups, layouts_per_group)]


def model_state(infos, params_by_index: Dict[int, torch.Tensor], buffers: Dict[str, torch.Tensor]):
    out = OrderedDict()
    for info in infos:
        t = params_by_index.get(info.index)
        if t is None:
            t = _cpu_clone(info.frozen_master)
        for name in info.names:
            out[name] = t
    out.update(buffers)
    return out


# ---------------------------------------------------------------------- live model
def _gather_flat(model, unit, shard_value: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(unit.layout.padded_numel, dtype=shard_value.dtype, device=shard_value.device)
    dist.all_gather_into_tensor(flat, shard_value.detach().contiguous(), group=model.process_group)
    return flat


def _shard_units(model, optimizer) -> List[list]:
    """The unit of every optimizer parameter, per group; ValueError for foreign parameters."""
    unit_of = {id(u.shard): u for u in model.units}
    per_group = []
    for g_idx, g in enumerate(optimizer.param_groups):
        units = []
        for p in g["params"]:
            if id(p) not in unit_of:
                raise ValueError(f"optimizer param_groups[{g_idx}] holds a {tuple(p.shape)} tensor that is not one of "
                                 f"this FullyShardedDataParallel's parameters(); build the optimizer from "
                                 f"model.parameters()")
            units.append(unit_of[id(p)])
        per_group.append(units)
    return per_group


def full_state_dict(model, rank0_only: bool = False) -> dict:
    params = {}
    for unit in model.units:                           # NOTE: collective, same unit order on every rank
        params.update(split_flat(unit.layout, _gather_flat(model, unit, unit.shard)))
    if rank0_only and model.process_group.rank != 0:
        return OrderedDict()
    buffers = {name: _cpu_clone(b) for name, b in named_buffers_all(model.module)}
    return model_state(model._param_infos, params, buffers)


def full_optim_state_dict(model, optimizer, rank0_only: bool = False) -> dict:
    per_group = _shard_units(model, optimizer)
    state = {}
    for g, units in zip(optimizer.param_groups, per_group):
        for p, unit in zip(g["params"], units):
            st = optimizer.state.get(p, {})
            state.update(unflatten_state(unit.layout, st, lambda key, v, u=unit: _gather_flat(model, u, v)))
    if rank0_only and model.process_group.rank != 0:
        return {}
    groups = full_groups(optimizer.param_groups, [[u.layout for u in units] for units in per_group])
    return {"state": {k: state[k] for k in sorted(state) if state[k]}, "param_groups": groups}


# ---------------------------------------------------------------------- loading
def _load_model(model, state_dict: dict, strict: bool) -> None:
    infos = model._param_infos
    buffers = dict(named_buffers_all(model.module))
    expected = {n for i in infos for n in i.names} | set(buffers)
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")

    def lookup(info):
        for n in info.names:
            if n in state_dict:
                t = state_dict[n]
                if tuple(t.shape) != tuple(info.shape):
                    raise ValueError(f"load_full_state_dict: '{n}' has shape {tuple(t.shape)}, "
                                     f"expected {tuple(info.shape)}")
                return t
        return None

    by_index = {i.index: i for i in infos}
    rank = model.process_group.rank
    with torch.no_grad():
        for unit in model.units:
            found = [lookup(by_index[s.param_index]) for s in unit.layout.slots]
            if any(t is None for t in found):
                continue                               # non-strict and missing: keep current values
            unit.layout.shard_from_params(rank, found, unit.shard.detach())
        for info in infos:
            t = lookup(info) if info.frozen_master is not None else None
            if t is not None:
                info.frozen_master.copy_(t)
                dtype = model.policy.param_dtype
                install(info, info.frozen_master.to(dtype) if dtype is not None and t.is_floating_point()
                        else info.frozen_master)
        for name, buf in buffers.items():
            if name in state_dict:
                buf.copy_(state_dict[name])


def _load_optim(model, osd: dict, optimizer) -> None:
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise TypeError("load_full_state_dict: optim_state_dict must be a torch.optim state dict "
                        "({'state': ..., 'param_groups': ...})")
    saved_state = {int(k): v for k, v in osd["state"].items()}
    group_of = {idx: g for g in osd["param_groups"] for idx in g["params"]}
    rank = model.process_group.rank
    new_state, new_groups, pos = {}, [], 0
    for g, units in zip(optimizer.param_groups, _shard_units(model, optimizer)):
        hyper, positions = None, []
        for unit in units:
            slots = unit.layout.slots
            missing = [s.name for s in slots if s.param_index not in group_of]
            if missing:
                raise ValueError(f"load_full_state_dict: optimizer state dict has no param group holding "
                                 f"{missing} (positions {[s.param_index for s in slots if s.name in missing]})")
            if hyper is None:
                hyper = {k: v for k, v in group_of[slots[0].param_index].items() if k != "params"}
            entries = [saved_state.get(s.param_index) or {} for s in slots]
            st = {}
            for key in dict.fromkeys(k for e in entries for k in e):
                values = [e.get(key) for e in entries]
                i0, first = next((i, v) for i, v in enumerate(values) if v is not None)
                if is_full_value(key, first, slots[i0].shape):
                    shard = torch.zeros(unit.layout.shard_numel, dtype=first.dtype, device=unit.shard.device)
                    unit.layout.shard_from_params(rank, values, shard)
                    st[key] = shard
                else:
                    st[key] = copy.deepcopy(first)
            if st:
                new_state[pos] = st
            positions.append(pos)
            pos += 1
        new_groups.append({**hyper, "params": positions})
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})


def load_full_state_dict(model, state_dict: Optional[dict], optim_state_dict: Optional[dict], optimizer,
                         strict: bool = True) -> None:
    if state_dict is None and optim_state_dict is None:
        raise ValueError("load_full_state_dict: give state_dict, optim_state_dict (with optimizer), or both")
    if optim_state_dict is not None and optimizer is None:
        raise ValueError("load_full_state_dict: optim_state_dict needs the optimizer to load it into")
    if state_dict is not None:
        _load_model(model, state_dict, strict)
    if optim_state_dict is not None:
        _load_optim(model, optim_state_dict, optimizer)
