"""A full state dict from a tensor-parallel model: every TP shard gathered back into the whole
tensor under the model's own names, so the unsharded model loads it (a Hugging Face model:
`LlamaForCausalLM(config).load_state_dict(sd)`, or `save_pretrained(path, state_dict=sd)`).
Shard layouts come from what parallelize_module recorded, not from the parameters, so it works
when DDP or ZeRO hold them (ZeRO-3 replaces them with flat shards).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn

from ..comm import distributed as dist
from ..comm.groups import resolve_group
from .plan import SHARD_SPECS_ATTR, shard_specs


def unshard_tensor(shards: Sequence[torch.Tensor], dim: int, num_chunks: int = 1) -> torch.Tensor:
    """Inverse of shard_tensor: the TP ranks' slices (in rank order) -> the full tensor. With
    num_chunks > 1 each slice is [q_r | k_r | v_r] and the result [q | k | v]."""
    if num_chunks == 1:
        return torch.cat(list(shards), dim)
    per_rank = [s.chunk(num_chunks, dim) for s in shards]
    return torch.cat([torch.cat([blocks[c] for blocks in per_rank], dim) for c in range(num_chunks)], dim)


def _tp_model(model: nn.Module) -> nn.Module:
    """The module parallelize_module returned, inside DDP / FullyShardedDataParallel wrappers."""
    inner = model
    while getattr(inner, SHARD_SPECS_ATTR, None) is None and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    return inner


def unsharded_state_dict(model: nn.Module, tp_group=None, state_dict: Optional[Dict[str, torch.Tensor]] = None,
                         partial: bool = False) -> Dict[str, torch.Tensor]:
    """{name: full tensor} of a model from parallelize_module (or DDP / FullyShardedDataParallel
    around one). state_dict: this rank's TP-sharded state dict under the TP model's names; by
    default the wrapper's full_state_dict() (ZeRO) or the TP model's state_dict(). Collective
    over tp_group: every TP rank calls it and gets the same result, on the devices of
    `state_dict`'s tensors. partial: `state_dict` holds only some of the model's entries (a
    pipeline stage's, under the whole model's names); the TP parameters it lacks are not an error."""
    tp_model = _tp_model(model)
    specs = shard_specs(tp_model)
    if state_dict is None:
        state_dict = model.full_state_dict() if hasattr(model, "full_state_dict") else tp_model.state_dict()
    group = dist.get_default_group() if tp_group is None else resolve_group(tp_group)
    tp_size = group.world_size
    comm_device = group.backend.device
    missing = sorted(set(specs) - set(state_dict))
    if missing and not partial:
        raise ValueError(f"unsharded_state_dict: the state dict lacks the tensor-parallel parameters {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}; pass one keyed like the TP model's own names")
    full = {}
    for key, value in state_dict.items():
        spec = specs.get(key)
        if spec is None or tp_size == 1:
            full[key] = value.detach().clone()
            continue
        dim, num_chunks = spec
        local = value.detach().to(comm_device).contiguous()
        gathered = torch.empty((tp_size,) + tuple(local.shape), dtype=local.dtype, device=comm_device)
        dist.all_gather_into_tensor(gathered, local, group=group)  # (tp, *shard shape)
        full[key] = unshard_tensor(gathered.unbind(0), dim, num_chunks).to(value.device)
    return full
