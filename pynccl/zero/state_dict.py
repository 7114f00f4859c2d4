"""Full (consolidated) state dicts of a sharded model and its optimizer, and loading them back
(full tensors, or the DTensors of sharded_state.py / dcp.py).

The full forms are exactly what an unwrapped model and a plain torch optimizer produce:
model keys are the original parameter/buffer names (tied parameters under every name);
optimizer state is keyed by each parameter's position in the original module.parameters(),
param_groups list those positions. So a checkpoint moves freely between a plain run and
ZeRO runs of any world size and stage: loading only cuts each rank's rows out of the full
tensors.

The optimizer holds the module's own parameters (each this rank's rows, layout.py), so its
state is per parameter: per-element entries (Adam's exp_avg, SGD's momentum_buffer, ...) are
recognised by having the parameter's (local or full) shape; anything else (step counters,
None) is per tensor and copied.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import sys

import torch
from torch.nn.modules.module import _IncompatibleKeys

from ..comm import distributed as dist
from .layout import FlatLayout
from .params import install, named_buffers_all


def _cpu_clone(v):
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def is_per_element(key: str, v, shape: torch.Size) -> bool:
    """v is a per-element optimizer state entry of a tensor of `shape` (not a step counter)."""
    return isinstance(v, torch.Tensor) and v.shape == shape and not (v.dim() == 0 and key == "step")


def split_flat(layout: FlatLayout, flat: torch.Tensor) -> Dict[int, torch.Tensor]:
    """Full flat (padded_numel,) -> {param_index: parameter-shaped CPU tensor}."""
    return {s.param_index: _cpu_clone(v) for s, v in zip(layout.slots, layout.views(flat))}


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


def optimizer_params(model, optimizer) -> List[List[Tuple[object, int]]]:
    """Per optimizer group, (unit or None for a frozen parameter, slot index or param_index) of
    each parameter; ValueError for a tensor that is not one of the model's parameters."""
    where = {id(p): (u, i) for u in model.units for i, p in enumerate(u.params)}
    where.update({id(info.param): (None, info.index) for info in model._param_infos if info.frozen_master is not None})
    per_group = []
    for g_idx, g in enumerate(optimizer.param_groups):
        row = []
        for p in g["params"]:
            if id(p) not in where:
                raise ValueError(f"optimizer param_groups[{g_idx}] holds a {tuple(p.shape)} tensor that is not one of "
                                 f"this FullyShardedDataParallel's parameters(); build the optimizer from "
                                 f"model.parameters() or model.named_parameters()")
            row.append(where[id(p)])
        per_group.append(row)
    return per_group


def param_index_of(entry) -> int:
    unit, i = entry
    return i if unit is None else unit.layout.slots[i].param_index


def full_state_dict(model, rank0_only: bool = False) -> dict:
    # NOTE: one unit's full flat buffer at a time on the device; with rank0_only the other ranks
    # drop each unit's CPU copy at once, so no rank but rank 0 ever holds the whole model.
    keep = not rank0_only or dist.get_rank(model.process_group) == 0
    params = {}
    for unit in model.units:                           # NOTE: collective, same unit order on every rank
        unit.check_params()
        flat = _gather_flat(model, unit, unit.shard)
        if keep:
            params.update(split_flat(unit.layout, flat))
        del flat
    if not keep:
        return OrderedDict()
    buffers = {name: _cpu_clone(b) for name, b in named_buffers_all(model.module)}
    return model_state(model._param_infos, params, buffers)


def _per_element_keys(unit, states: Dict[int, dict]) -> List[str]:
    """Keys of the per-element entries of `unit`'s parameters in `states` (slot -> state),
    decided from facts every rank shares (key names, the number of dimensions), since each
    key is then gathered collectively. 0-d parameters follow their unit's other parameters."""
    shaped = [i for i in states if unit.params[i].dim() > 0]
    if not shaped:
        return sorted({k for st in states.values() for k, v in st.items()
                       if isinstance(v, torch.Tensor) and k != "step"})
    return sorted({k for i in shaped for k, v in states[i].items()
                   if isinstance(v, torch.Tensor) and v.dim() == unit.params[i].dim()
                   and v.shape[1:] == unit.params[i].shape[1:]})


def full_optim_state_dict(model, optimizer, rank0_only: bool = False) -> dict:
    keep = not rank0_only or dist.get_rank(model.process_group) == 0   # as full_state_dict
    per_group = optimizer_params(model, optimizer)
    entries = [e for row in per_group for e in row]
    state: Dict[int, dict] = {}
    for info in model._param_infos:                    # frozen parameters are whole on every rank
        if info.frozen_master is not None and (None, info.index) in entries:
            state[info.index] = {k: _cpu_clone(v) for k, v in optimizer.state.get(info.param, {}).items()}
    for unit in model.units:                           # NOTE: collective, same unit and key order everywhere
        states = {i: optimizer.state.get(unit.params[i], {}) for u, i in entries if u is unit}
        keys = _per_element_keys(unit, states)
        for i, st in states.items():
            state[unit.layout.slots[i].param_index] = {k: _cpu_clone(v) for k, v in st.items() if k not in keys}
        for key in keys:
            local = [states.get(i, {}).get(key) for i in range(len(unit.params))]
            dtype = next(v.dtype for v in local if v is not None)
            shard = torch.zeros(unit.layout.shard_numel, dtype=dtype, device=unit.shard.device)
            for view, v in zip(unit.layout.local_views(unit.rank, shard), local):
                if v is not None:
                    view.copy_(v)
            flat = _gather_flat(model, unit, shard)     # NOTE: collective: on every rank, kept or not
            full = split_flat(unit.layout, flat) if keep else {}
            del flat, shard
            for i in states if keep else ():
                index = unit.layout.slots[i].param_index
                state[index][key] = full[index]
    if not keep:
        return {}
    groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
               "params": [param_index_of(e) for e in row]} for g, row in zip(optimizer.param_groups, per_group)]
    return {"state": {k: state[k] for k in sorted(state) if state[k]}, "param_groups": groups}


# ---------------------------------------------------------------------- loading
def is_dtensor(v) -> bool:
    """v is a torch DTensor (no DTensor exists unless torch.distributed.tensor was imported, which
    costs seconds: pynccl imports it only once DTensors are in play, see sharded_state.py)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(v, module.DTensor)


def _whole(v):
    if is_dtensor(v):
        from .sharded_state import whole_of
        return whole_of(v)
    return v


class StateDictKeyError(KeyError, RuntimeError):
    """Missing or unexpected keys under strict loading: a RuntimeError as torch's load_state_dict raises."""


def load_model_state_dict(model, state_dict: dict, strict: bool = True):
    """Load full tensors (a consolidated or plain-model state dict) or DTensors (sharded_state.py:
    ours, FSDP2's, DCP-loaded at any world size); each rank keeps its rows. Collective when any
    value is a DTensor. Returns torch's _IncompatibleKeys(missing, unexpected)."""
    infos = model._param_infos
    buffers = dict(named_buffers_all(model.module))
    expected = {n for i in infos for n in i.names} | set(buffers)
    order = model.module.state_dict(keep_vars=True)    # its keys in torch's order (references only)
    missing = [k for k in order if k in expected and k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise StateDictKeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")

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
    group = model.process_group
    rank = group.group_rank
    with torch.no_grad():
        for unit in model.units:                       # NOTE: collective (DTensors), same order everywhere
            # Non-strict: the slots found load, the missing ones keep their current values (as torch).
            found = {i: t for i, t in enumerate(lookup(by_index[s.param_index]) for s in unit.layout.slots)
                     if t is not None}
            if not found:
                continue
            unit.check_params()
            views = unit.layout.local_views(rank, unit.shard)
            if not any(is_dtensor(t) for t in found.values()):
                for i, t in found.items():
                    views[i].copy_(unit.layout.local_part(rank, i, t))
                continue
            from .sharded_state import chunk_of, chunks_to_unit
            chunks = {i: chunk_of(t, unit.layout.slots[i].shape, group, f"'{unit.layout.slots[i].name}'")
                      for i, t in found.items()}
            for i, rows in chunks_to_unit(unit, chunks, unit.master_dtype).items():
                views[i].copy_(rows)
        for info in infos:
            t = lookup(info) if info.frozen_master is not None else None
            if t is not None:
                info.frozen_master.copy_(_whole(t))
                dtype = model.policy.param_dtype
                install(info, info.frozen_master.to(dtype) if dtype is not None and t.is_floating_point()
                        else info.frozen_master)
        for name, buf in buffers.items():
            if name in state_dict:
                buf.copy_(_whole(state_dict[name]))
    model._runtime.mark_stale()
    return _IncompatibleKeys(missing, unexpected)


def local_optim_state_dict(model, osd: dict, optimizer) -> dict:
    """A full torch.optim state dict (positional ids of the original module.parameters()) cut to
    this rank's rows, positional as this `optimizer`: what optimizer.load_state_dict takes.
    Positional, as torch.optim.Optimizer.load_state_dict: the i-th parameter of the saved
    group g is the i-th parameter of this optimizer's group g (same recipe, same order)."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise TypeError("load_full_state_dict: optim_state_dict must be a torch.optim state dict "
                        "({'state': ..., 'param_groups': ...})")
    per_group = optimizer_params(model, optimizer)
    saved_groups = osd["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(row) for row in per_group]:
        raise ValueError(f"load_full_state_dict: the optimizer state dict has groups of "
                         f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer "
                         f"{[len(row) for row in per_group]}; build it with the same param groups")
    saved_state = {int(k): v for k, v in osd["state"].items()}
    rank = model.process_group.group_rank
    new_state, new_groups, pos = {}, [], 0
    for saved, row in zip(saved_groups, per_group):
        positions = []
        for key_in_saved, (unit, i) in zip(saved["params"], row):
            st = {}
            for key, v in (saved_state.get(int(key_in_saved)) or {}).items():
                if unit is not None and is_per_element(key, v, unit.layout.slots[i].shape):
                    st[key] = unit.layout.local_part(rank, i, v).to(unit.shard.device, copy=True)
                else:
                    st[key] = copy.deepcopy(v)
            if st:
                new_state[pos] = st
            positions.append(pos)
            pos += 1
        new_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": positions})
    return {"state": new_state, "param_groups": new_groups}


def load_full_state_dict(model, state_dict: Optional[dict], optim_state_dict: Optional[dict], optimizer,
                         strict: bool = True) -> None:
    if state_dict is None and optim_state_dict is None:
        raise ValueError("load_full_state_dict: give state_dict, optim_state_dict (with optimizer), or both")
    if optim_state_dict is not None and optimizer is None:
        raise ValueError("load_full_state_dict: optim_state_dict needs the optimizer to load it into")
    if state_dict is not None:
        load_model_state_dict(model, state_dict, strict)
    if optim_state_dict is not None:
        optimizer.load_state_dict(local_optim_state_dict(model, optim_state_dict, optimizer))
