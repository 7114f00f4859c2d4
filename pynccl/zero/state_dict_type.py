"""torch FSDP1's state-dict switches on pynccl.FullyShardedDataParallel (static methods there, as
in torch): set_state_dict_type / state_dict_type choose what model.state_dict() and
optim_state_dict return, with torch's own StateDictType and FullStateDictConfig.

The default differs from FSDP1's: SHARDED_STATE_DICT (DTensors, FSDP2's behaviour and what
torch.distributed.checkpoint saves without gathering); FULL_STATE_DICT gives the consolidated
CPU tensors (rank 0 only with FullStateDictConfig(rank0_only=True)). LOCAL_STATE_DICT (flat
shards) is refused with a pointer to save_sharded, which writes them.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import state_dict as sd

# NOTE: torch.distributed.fsdp and dcp.py (torch.distributed.checkpoint, DTensor: seconds to import)
# are imported on first use; a model whose setting was never changed needs neither to exist.

SETTINGS_ATTR = "_pynccl_state_dict_settings"


def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
    """What module.state_dict() (and optim_state_dict) return, as torch FSDP1's
    FullyShardedDataParallel.set_state_dict_type: SHARDED_STATE_DICT (default: DTensors, FSDP2's
    form) or FULL_STATE_DICT (full CPU tensors; FullStateDictConfig(rank0_only=True): rank 0 only).
    Returns the previous settings."""
    from torch.distributed.fsdp import StateDictSettings, StateDictType

    from .dcp import _check_model
    _check_model(module, "set_state_dict_type")
    if state_dict_type not in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        raise ValueError(f"set_state_dict_type: supported are StateDictType.FULL_STATE_DICT and SHARDED_STATE_DICT, "
                         f"got {state_dict_type!r} (LOCAL_STATE_DICT's flat shards: model.save_sharded)")
    previous = get_state_dict_settings(module)
    setattr(module, SETTINGS_ATTR, StateDictSettings(state_dict_type, state_dict_config, optim_state_dict_config))
    return previous


def get_state_dict_settings(module):
    """torch's StateDictSettings of `module` (SHARDED_STATE_DICT unless set_state_dict_type changed it)."""
    from torch.distributed.fsdp import StateDictSettings, StateDictType
    return getattr(module, SETTINGS_ATTR, None) or StateDictSettings(StateDictType.SHARDED_STATE_DICT, None, None)


@contextlib.contextmanager
def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
    """set_state_dict_type for the duration of a `with` block, as FSDP1's context manager."""
    previous = set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        setattr(module, SETTINGS_ATTR, previous)


def _rank0_only(config) -> bool:
    return bool(getattr(config, "rank0_only", False))          # torch's FullStateDictConfig


def _is_full(settings) -> bool:
    return settings is not None and settings.state_dict_type.name == "FULL_STATE_DICT"


def module_state_dict(module) -> dict:
    """module.state_dict() under the current setting."""
    settings = getattr(module, SETTINGS_ATTR, None)
    if _is_full(settings):
        return sd.full_state_dict(module, rank0_only=_rank0_only(settings.state_dict_config))
    from .dcp import sharded_model_state_dict
    return sharded_model_state_dict(module)


def optim_state_dict(model, optim: torch.optim.Optimizer, optim_state_dict: Optional[dict] = None,
                     group=None) -> dict:
    """FSDP1's FullyShardedDataParallel.optim_state_dict: name-keyed, sharded or full per the setting."""
    if optim_state_dict is not None or group is not None:
        raise ValueError("optim_state_dict: optim_state_dict and group are not supported; pass the model and optimizer")
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from .dcp import get_optimizer_state_dict
    settings = getattr(model, SETTINGS_ATTR, None)
    full = _is_full(settings)
    rank0 = full and _rank0_only(settings.optim_state_dict_config)
    return get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=full, cpu_offload=rank0))


def optim_state_dict_to_load(model, optim: torch.optim.Optimizer, optim_state_dict: dict,
                             is_named_optimizer: bool = False, load_directly: bool = False, group=None):
    """FSDP1's FullyShardedDataParallel.optim_state_dict_to_load (argument order: model, optim, osd)."""
    from .dcp import optim_state_dict_to_load as to_load
    osd = to_load(model, optim, optim_state_dict)
    if load_directly:
        optim.load_state_dict(osd)
    return osd
