"""Consolidated Hugging Face checkpoint of a ZeRO-sharded model:

    pynccl.zero.save_pretrained(model, "out/")        # collective; rank 0 writes
    LlamaForCausalLM.from_pretrained("out/")          # the plain model, same weights

The full model never sits in one rank's device memory: units are all-gathered one at a time
(state_dict.full_state_dict), each copied to CPU on rank 0 only and freed before the next, so
device memory grows by one unit's flat buffer at most, and ranks other than 0 keep nothing.
Rank 0 then hands the CPU state dict to the module's own save_pretrained (safetensors, config,
shards of max_shard_size, tied weights: all as Hugging Face does them).
"""
from __future__ import annotations

import os

from ..comm import distributed as dist
from . import state_dict as sd
from .checkpoint import _agree


def save_pretrained(model, save_directory: str | os.PathLike, **kwargs) -> None:
    """model.module.save_pretrained(save_directory, state_dict=<full weights>, **kwargs) on rank 0
    of the ZeRO group, for a FullyShardedDataParallel around a Hugging Face PreTrainedModel.
    Collective: every rank calls it; an error on rank 0 raises on every rank."""
    from .fsdp import FullyShardedDataParallel
    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"save_pretrained: expected a pynccl.FullyShardedDataParallel, got {type(model).__name__}")
    if not callable(getattr(model.module, "save_pretrained", None)):
        raise TypeError(f"save_pretrained: the wrapped {type(model.module).__name__} has no save_pretrained (not a "
                        f"Hugging Face PreTrainedModel); use model.full_state_dict(rank0_only=True) and torch.save")
    if "state_dict" in kwargs:
        raise ValueError("save_pretrained: state_dict is gathered here from the shards; do not pass one")
    group = model.process_group
    full = sd.full_state_dict(model, rank0_only=True)   # NOTE: collective; empty on ranks other than 0
    error = None
    if dist.get_rank(group) == 0:
        try:
            model.module.save_pretrained(save_directory, state_dict=full, **kwargs)
        except Exception as e:  # noqa: BLE001 - every rank must reach the vote below
            error = e
    del full
    if not _agree(model, error is None):
        raise RuntimeError(f"save_pretrained: writing {save_directory} failed on rank 0"
                           + (f": {error!r}" if error else "")) from error
