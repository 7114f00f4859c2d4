"""torch.distributed.checkpoint (DCP) for ZeRO models, with torch's own entry points:

    from torch.distributed.checkpoint.state_dict import StateDictOptions
    import torch.distributed.checkpoint as dcp
    sd = {"model": model.state_dict(), "optim": pynccl.zero.get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=path)                    # every rank writes its rows
    dcp.load(sd, checkpoint_id=path)                    # any world size, any stage, or FSDP2's files
    model.load_state_dict(sd["model"]); pynccl.zero.set_optimizer_state_dict(model, opt, sd["optim"])

get_/set_model_state_dict, get_/set_optimizer_state_dict, get_/set_state_dict mirror
torch.distributed.checkpoint.state_dict (same arguments, torch's StateDictOptions) and give what
they give for FSDP2: DTensors with Shard(0) keyed by parameter name (sharded_state.py says how),
optimizer state keyed by parameter name with param_groups listing names. full_state_dict=True
gives the consolidated tensors instead (state_dict.py). model.state_dict() is the sharded form by
default, as FSDP2's; FSDP1's set_state_dict_type switches it (state_dict_type.py).

torch's own get_optimizer_state_dict cannot serve a pynccl model: it reads the optimizer's
tensors as they are, and ZeRO's are row shards of an uneven layout that DCP would take for
replicated whole tensors. Hence these functions.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Dict, Iterable, Optional, Union

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from ..comm import distributed as dist
from . import state_dict as sd
from .params import named_buffers_all
from .sharded_state import chunk_of, chunks_to_unit, device_mesh, unit_to_dtensors, whole_of, whole_to_dtensor

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]


# ---------------------------------------------------------------------- options
def _check_model(model, fn: str):
    if not getattr(model, "_pynccl_zero_model", False):       # FullyShardedDataParallel (fsdp.py) sets it
        raise TypeError(f"{fn}: expected a pynccl.FullyShardedDataParallel, got {type(model).__name__}")


def _options(options: Optional[StateDictOptions], fn: str) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"{fn}: options must be a torch.distributed.checkpoint.state_dict.StateDictOptions, "
                        f"got {type(options).__name__}")
    if options.broadcast_from_rank0:
        raise ValueError(f"{fn}: broadcast_from_rank0=True is not supported; give every rank the full state dict "
                         f"(or load a sharded one through dcp.load)")
    return options


def _one_optimizer(optimizers: Optimizers, fn: str) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    opts = list(optimizers)
    if len(opts) != 1 or not isinstance(opts[0], torch.optim.Optimizer):
        raise ValueError(f"{fn}: expected one torch.optim.Optimizer (or a list of one), got {len(opts)} objects")
    return opts[0]


def _no_submodules(submodules, fn: str) -> None:
    if submodules is not None:
        raise ValueError(f"{fn}: submodules is not supported (deprecated in torch); take the whole state dict")


# ---------------------------------------------------------------------- model
def sharded_model_state_dict(model, ignore_frozen_params: bool = False) -> Dict[str, object]:
    """{original name: DTensor Shard(0)} for parameters, plain tensors for buffers. Collective."""
    group = model.process_group
    mesh = device_mesh(group)
    rank = dist.get_rank(group)
    params = {}
    for unit in model.units:                           # NOTE: collective, same unit order on every rank
        unit.check_params()
        views = unit.layout.local_views(rank, unit.shard.detach())
        for i, t in unit_to_dtensors(unit, dict(enumerate(views)), mesh).items():
            params[unit.layout.slots[i].param_index] = t
    out = OrderedDict()
    for info in model._param_infos:
        t = params.get(info.index)
        if t is None:
            if ignore_frozen_params:
                continue
            t = whole_to_dtensor(info.frozen_master.detach(), mesh)
        for name in info.names:
            out[name] = t
    for name, buf in named_buffers_all(model.module):
        out[name] = buf.detach()
    return out


def get_model_state_dict(model, *, submodules=None, options: Optional[StateDictOptions] = None) -> dict:
    """As torch.distributed.checkpoint.state_dict.get_model_state_dict. Collective."""
    _check_model(model, "get_model_state_dict")
    _no_submodules(submodules, "get_model_state_dict")
    options = _options(options, "get_model_state_dict")
    if options.full_state_dict:
        full = sd.full_state_dict(model, rank0_only=options.cpu_offload)
        if options.ignore_frozen_params:
            frozen = {n for i in model._param_infos if not i.requires_grad for n in i.names}
            full = type(full)((k, v) for k, v in full.items() if k not in frozen)
        return full if options.cpu_offload else type(full)((k, _to(v, model.device)) for k, v in full.items())
    out = sharded_model_state_dict(model, options.ignore_frozen_params)
    if options.cpu_offload:
        out = type(out)((k, _to_cpu(v)) for k, v in out.items())
    return out


def _to(v, device):
    """full_state_dict without cpu_offload: torch's whole tensors stay on the device (ours are
    consolidated on the CPU, one unit at a time, and go back there)."""
    return v.to(device) if isinstance(v, torch.Tensor) else v


def _to_cpu(v):
    # As torch's cpu_offload: a DTensor keeps its mesh, its local tensor moves (DTensor.to does that;
    # DTensor.from_local would move it back to the mesh's device).
    return v.to("cpu") if isinstance(v, torch.Tensor) else v


def set_model_state_dict(model, model_state_dict: dict, *, options: Optional[StateDictOptions] = None):
    """As torch's set_model_state_dict: loads full tensors or DTensors (ours, FSDP2's, DCP-loaded). Collective."""
    _check_model(model, "set_model_state_dict")
    options = _options(options, "set_model_state_dict")
    return sd.load_model_state_dict(model, model_state_dict, options.strict)


# ---------------------------------------------------------------------- optimizer
def init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (zero grads, lr 0, one step), as torch's get_optimizer_state_dict
    does, so the state dict has the entries that dcp.load fills in."""
    if optimizer.state or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = []
    for g in optimizer.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step(closure=None)
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    optimizer.zero_grad(set_to_none=True)


def _names(model) -> Dict[int, str]:
    return {info.index: info.name for info in model._param_infos}


def sharded_optim_state_dict(model, optimizer) -> dict:
    """torch's get_optimizer_state_dict form: {'state': {name: {key: DTensor or value}},
    'param_groups': [{..., 'params': [names]}]}. Collective."""
    per_group = sd.optimizer_params(model, optimizer)
    entries = [e for row in per_group for e in row]
    names = _names(model)
    mesh = device_mesh(model.process_group)
    by_index = {info.index: info for info in model._param_infos}
    state: Dict[int, dict] = {}
    for unit, i in entries:
        if unit is None:                               # a frozen parameter: whole on every rank
            info = by_index[i]
            state[i] = {k: whole_to_dtensor(v.detach(), mesh) if sd.is_per_element(k, v, info.shape) else
                        _copy(v) for k, v in optimizer.state.get(info.param, {}).items()}
    for unit in model.units:                           # NOTE: collective, same unit and key order everywhere
        states = {i: optimizer.state.get(unit.params[i], {}) for u, i in entries if u is unit}
        if not states:
            continue
        keys = sd._per_element_keys(unit, states)
        for i, st in states.items():
            state[unit.layout.slots[i].param_index] = {k: _copy(v) for k, v in st.items() if k not in keys}
        for key in keys:
            present = {i: st[key].detach() for i, st in states.items() if key in st}
            ref = next(iter(present.values()))
            local = {i: present.get(i, torch.zeros(unit.params[i].shape, dtype=ref.dtype, device=ref.device))
                     for i in states}
            for i, t in unit_to_dtensors(unit, local, mesh).items():
                if i in present:
                    state[unit.layout.slots[i].param_index][key] = t
    order = [sd.param_index_of(e) for e in entries]
    groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
               "params": [names[sd.param_index_of(e)] for e in row]}
              for g, row in zip(optimizer.param_groups, per_group)]
    return {"state": {names[k]: state[k] for k in order if state.get(k)}, "param_groups": groups}


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def get_optimizer_state_dict(model, optimizers: Optimizers, *, submodules=None,
                             options: Optional[StateDictOptions] = None) -> dict:
    """As torch.distributed.checkpoint.state_dict.get_optimizer_state_dict (one optimizer). Collective.
    A fresh optimizer first gets its state (init_optim_state), as torch does, so dcp.load can fill it."""
    _check_model(model, "get_optimizer_state_dict")
    _no_submodules(submodules, "get_optimizer_state_dict")
    options = _options(options, "get_optimizer_state_dict")
    optimizer = _one_optimizer(optimizers, "get_optimizer_state_dict")
    init_optim_state(optimizer)
    if options.full_state_dict:
        out = sd.full_optim_state_dict(model, optimizer, rank0_only=options.cpu_offload)
        if out and not options.cpu_offload:
            out["state"] = _optim_state_on_device(model, optimizer, out["state"])
        out = _index_to_names(model, out) if out else out
    else:
        out = sharded_optim_state_dict(model, optimizer)
        if options.cpu_offload:
            out["state"] = {k: {kk: _to_cpu(vv) for kk, vv in st.items()} for k, st in out["state"].items()}
    return flatten_optim_state_dict(out) if options.flatten_optimizer_state_dict and out else out


def _optim_state_on_device(model, optimizer, state: dict) -> dict:
    """full_state_dict without cpu_offload, as torch's: per-element entries on the device, `step`
    where the optimizer keeps it (AdamW: on the CPU unless fused or capturable)."""
    steps = [st["step"].device for st in optimizer.state.values() if isinstance(st.get("step"), torch.Tensor)]
    step_device = steps[0] if steps else model.device
    return {i: {k: _to(v, step_device if k == "step" else model.device) for k, v in st.items()}
            for i, st in state.items()}


def flatten_optim_state_dict(osd: dict) -> dict:
    """torch's flatten_optimizer_state_dict form: 'state.<name>.<entry>' and, per parameter,
    'param_groups.<name>.<hyperparameter>' (what pipeline stages save: no shared non-tensor entry)."""
    flat = {f"state.{name}.{k}": v for name, st in osd["state"].items() for k, v in st.items()}
    for g in osd["param_groups"]:
        flat.update({f"param_groups.{name}.{k}": v for name in g["params"] for k, v in g.items() if k != "params"})
    return flat


def unflatten_optim_state_dict(flat: dict, group_names) -> dict:
    """flatten_optim_state_dict's inverse, for an optimizer whose groups hold `group_names` (lists of names)."""
    state: Dict[str, dict] = {}
    for key, v in flat.items():
        if key.startswith("state."):
            name, entry = key[len("state."):].rsplit(".", 1)
            state.setdefault(name, {})[entry] = v
    groups = []
    for names in group_names:
        prefix = f"param_groups.{names[0]}." if names else None
        hyper = {k[len(prefix):]: v for k, v in flat.items()
                 if prefix and k.startswith(prefix) and "." not in k[len(prefix):]}
        groups.append({**hyper, "params": list(names)})
    return {"state": state, "param_groups": groups}


def _index_to_names(model, osd: dict) -> dict:
    names = _names(model)
    return {"state": {names[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}


def _nested(model, optimizer, osd: dict) -> dict:
    """osd in the nested form (a flattened one, torch's flatten_optimizer_state_dict, unflattened)."""
    if "state" not in osd and any(str(k).startswith("state.") for k in osd):
        names = _names(model)
        rows = sd.optimizer_params(model, optimizer)
        osd = unflatten_optim_state_dict(osd, [[names[sd.param_index_of(e)] for e in row] for row in rows])
    if not isinstance(osd.get("state"), dict) or not isinstance(osd.get("param_groups"), list):
        raise TypeError("optim_state_dict_to_load: expected {'state': {...}, 'param_groups': [...]}")
    return osd


def _positions(model, optimizer, groups: list, index_of: Dict[str, int]):
    """({(unit, slot): position in this optimizer}, its param_groups with the saved hyperparameters):
    each group takes the hyperparameters of the saved group that holds its first parameter."""
    group_of = {index_of[p]: g for g in groups for p in g["params"]}
    pos, new_groups = {}, []
    for g_idx, row in enumerate(sd.optimizer_params(model, optimizer)):
        saved = group_of.get(sd.param_index_of(row[0])) if row else (groups[g_idx] if g_idx < len(groups) else None)
        if saved is None:
            raise ValueError(f"optim_state_dict_to_load: no saved param group holds the parameters of this "
                             f"optimizer's param_groups[{g_idx}]; build the optimizer with the same groups")
        new_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": [pos.setdefault(e, len(pos)) for e in row]})
    return pos, new_groups


def _unit_states(model, unit, slots, saved: Dict[int, dict]) -> Dict[int, dict]:
    """{slot: this rank's optimizer state} of `unit`'s `slots` from name-keyed saved states
    (per-element entries cut to this rank's rows, one row exchange per entry). Collective."""
    st = {i: saved.get(unit.layout.slots[i].param_index, {}) for i in slots}
    shape = {i: unit.layout.slots[i].shape for i in slots}
    keys = sorted({k for i in slots for k, v in st[i].items() if sd.is_per_element(k, v, shape[i])})
    out = {i: {k: _local_copy(v) for k, v in st[i].items() if k not in keys} for i in slots}
    for key in keys:
        # NOTE: every rank holds the same entries (one dcp.load, or one full dict), so the same slots.
        chunks = {i: chunk_of(st[i][key], shape[i], model.process_group,
                              f"optimizer state '{key}' of '{unit.layout.slots[i].name}'")
                  for i in slots if key in st[i]}
        dtype = next(iter(chunks.values())).dtype
        for i, t in chunks_to_unit(unit, chunks, dtype).items():
            out[i][key] = t
    return out


def optim_state_dict_to_load(model, optimizer, optim_state_dict: dict) -> dict:
    """The state dict `optimizer.load_state_dict` takes (this rank's rows, positional ids) from a
    name-keyed one (sharded DTensors, full tensors, nested or flattened) or a positional full one.
    Collective."""
    osd = _nested(model, optimizer, optim_state_dict)
    state, groups = osd["state"], osd["param_groups"]
    if all(isinstance(k, int) for k in state) and all(isinstance(p, int) for g in groups for p in g["params"]):
        return sd.local_optim_state_dict(model, osd, optimizer)
    index_of = {n: info.index for info in model._param_infos for n in info.names}
    unknown = sorted(str(k) for k in list(state) + [p for g in groups for p in g["params"]] if k not in index_of)
    if unknown:
        raise KeyError(f"optim_state_dict_to_load: {unknown[:4]} are not parameter names of this model")
    saved = {index_of[k]: v for k, v in state.items()}
    pos, new_groups = _positions(model, optimizer, groups, index_of)
    new_state: Dict[int, dict] = {}
    by_index = {info.index: info for info in model._param_infos}
    for (unit, i), p in pos.items():
        if unit is None:                               # a frozen parameter: whole on every rank
            new_state[p] = {k: whole_of(v).clone() if sd.is_per_element(k, v, by_index[i].shape) else _local_copy(v)
                            for k, v in saved.get(i, {}).items()}
    for unit in model.units:                           # NOTE: collective, same unit order everywhere
        states = _unit_states(model, unit, [i for u, i in pos if u is unit], saved)
        new_state.update({pos[(unit, i)]: st for i, st in states.items()})
    return {"state": {p: s for p, s in new_state.items() if s}, "param_groups": new_groups}


def _local_copy(v):
    if isinstance(v, DTensor):
        return v.to_local().clone() if all(p.is_replicate() for p in v.placements) else v.full_tensor()
    return _copy(v)


def set_optimizer_state_dict(model, optimizers: Optimizers, optim_state_dict: dict, *,
                             options: Optional[StateDictOptions] = None) -> None:
    """As torch's set_optimizer_state_dict: loads get_optimizer_state_dict's form (sharded, or
    full_state_dict=True's), FSDP2's, or DCP-loaded at another world size or stage. Collective."""
    _check_model(model, "set_optimizer_state_dict")
    _options(options, "set_optimizer_state_dict")
    optimizer = _one_optimizer(optimizers, "set_optimizer_state_dict")
    optimizer.load_state_dict(optim_state_dict_to_load(model, optimizer, optim_state_dict))


def get_state_dict(model, optimizers: Optimizers, *, submodules=None, options: Optional[StateDictOptions] = None):
    """(get_model_state_dict, get_optimizer_state_dict), as torch's get_state_dict."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_state_dict(model, optimizers: Optimizers, *, model_state_dict: dict, optim_state_dict: dict,
                   options: Optional[StateDictOptions] = None):
    """set_model_state_dict + set_optimizer_state_dict, as torch's set_state_dict."""
    keys = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return keys


__all__ = ["get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict",
           "get_state_dict", "set_state_dict", "StateDictOptions"]
