"""A pipeline stage's state dicts under the whole model's names, so a checkpoint moves between
pipeline layouts (another pp size, other boundaries, interleaved or not) and to an unpipelined
model:

    stage_sd = to_model_keys(stage.state_dict(), stage, model)          # "layers.0..." -> "model.layers.4..."
    dcp.save({"model": stage_sd, ...})                                  # each rank its stage's entries
    ... at another layout: sd = to_model_keys(stage.state_dict(), stage, model); dcp.load({"model": sd}, ...)
    stage.load_state_dict(to_stage_keys(sd, stage, model))

DCP takes state dicts whose keys differ from rank to rank (each holds its stage's), and loads
each rank's keys wherever the saving ranks wrote them. Names come from module identity: a stage
holds the model's own submodules (hf_stage_modules, build_stage_module with modules), so each
entry's name in the model is its module's name there, plus the attribute. Works for any state
dict keyed like the stage's: the stage's own, a ZeRO wrapper's (pynccl.FullyShardedDataParallel
around the stage: sharded DTensors), a TP one (tensor_parallel.sharded_state_dict), and optimizer
state dicts keyed by parameter name, flattened (StateDictOptions(flatten_optimizer_state_dict=True):
'state.<name>.exp_avg', 'param_groups.<name>.lr', ...), which is the form to save across stages:
DCP keeps a single rank's copy of a non-tensor entry, so a nested dict's param_groups, listing one
stage's parameters, would come back the same on every rank.
"""
from __future__ import annotations

from typing import Dict

from torch import nn


def _join(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def model_names(stage: nn.Module, model: nn.Module) -> Dict[str, str]:
    """{name of a stage parameter or persistent buffer: its name in `model`}."""
    where: Dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        where.setdefault(id(mod), name)
    out = {}
    for stage_name, mod in stage.named_modules(remove_duplicate=False):
        attrs = [a for a, p in mod._parameters.items() if p is not None]
        attrs += [a for a, b in mod._buffers.items() if b is not None and a not in mod._non_persistent_buffers_set]
        if not attrs:
            continue
        if id(mod) not in where:
            raise ValueError(f"model_names: the stage's module '{stage_name or '<root>'}' "
                             f"({type(mod).__name__}) holds {attrs} but is not a submodule of the model; "
                             f"build stages from the model's own modules")
        for a in attrs:
            out[_join(stage_name, a)] = _join(where[id(mod)], a)
    return out


_FLAT_PREFIXES = ("state.", "param_groups.")


def _rename_key(key: str, names: Dict[str, str]):
    """A state-dict key under `names`, or None. Also the keys of a flattened optimizer state dict
    (torch's flatten_optimizer_state_dict: 'state.<name>.<entry>', 'param_groups.<name>.<hyper>')."""
    if key in names:
        return names[key]
    for prefix in _FLAT_PREFIXES:
        if key.startswith(prefix) and "." in key[len(prefix):]:
            name, entry = key[len(prefix):].rsplit(".", 1)
            if name in names:
                return f"{prefix}{names[name]}.{entry}"
    return None


def _rename(state_dict: dict, names: Dict[str, str], what: str, keep_unknown: bool) -> dict:
    nested = set(state_dict) >= {"state", "param_groups"} and isinstance(state_dict["param_groups"], list)
    keys = list(state_dict["state"]) + [p for g in state_dict["param_groups"] for p in g["params"]] \
        if nested else list(state_dict)
    unknown = [k for k in keys if _rename_key(k, names) is None]
    if unknown and not keep_unknown:
        raise KeyError(f"{what}: {unknown[:4]} are not names of the stage's parameters or buffers")
    if nested:
        # NOTE: for dcp.save across stages, flatten it instead (flatten_optimizer_state_dict=True):
        # DCP keeps one rank's copy of non-tensor entries such as param_groups.
        state = {names[k]: v for k, v in state_dict["state"].items() if k in names}
        groups = [{**g, "params": [names[p] for p in g["params"] if p in names]} for g in state_dict["param_groups"]]
        return {**state_dict, "state": state, "param_groups": groups}
    return {new: v for new, v in ((_rename_key(k, names), v) for k, v in state_dict.items()) if new is not None}


def to_model_keys(state_dict: dict, stage: nn.Module, model: nn.Module) -> dict:
    """A state dict keyed like `stage`'s (model or name-keyed optimizer) re-keyed with the model's names."""
    return _rename(state_dict, model_names(stage, model), "to_model_keys", keep_unknown=False)


def to_stage_keys(state_dict: dict, stage: nn.Module, model: nn.Module) -> dict:
    """The entries of a model-keyed state dict that belong to `stage`, under the stage's names
    (the rest, other stages' entries, is left out)."""
    back = {m: s for s, m in model_names(stage, model).items()}
    return _rename(state_dict, back, "to_stage_keys", keep_unknown=True)
