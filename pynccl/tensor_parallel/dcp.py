"""Sharded state dicts of a tensor-parallel model for torch.distributed.checkpoint (DCP): each
TP-sharded parameter a DTensor with Shard(dim) over a 1-D DeviceMesh of the TP group, as
torch.distributed.tensor.parallel's modules hold them; replicated parameters and buffers stay
plain tensors (DCP writes a plain tensor that several ranks hold once). So a checkpoint saved at
one TP size loads at another, into a ZeRO or FSDP2 model, and dcp_to_torch_save makes it the
unsharded model's state dict.

    sd = {"model": tp.sharded_state_dict(model, g), "optim": tp.sharded_optim_state_dict(model, opt, g)}
    dcp.save(sd, checkpoint_id=path)  ...  dcp.load(sd, checkpoint_id=path)
    tp.load_sharded_state_dict(model, sd["model"], g); tp.load_sharded_optim_state_dict(model, opt, sd["optim"], g)

A fused parameter (num_fused > 1: GPT-2's [q | k | v]) holds [q_r | k_r | v_r] on rank r, which
is not one contiguous chunk of the whole tensor: its rows move to torch.chunk's layout with one
all_to_all (comm/row_exchange.py) on the way out, and back on the way in. Padded vocabularies
(VocabParallelEmbedding) are saved padded: they load only at a TP size with the same padding.
The model must not be inside ZeRO (its parameters are then ZeRO's row shards): 2-D ZeRO × TP
checkpoints are not supported here; DDP around the TP model is.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as tsd
from torch.distributed.tensor import DTensor, Shard

from ..comm import distributed as dist
from ..comm.groups import resolve_group
from ..comm.dtensor_state import device_mesh, same_ranks, to_dtensor, whole_of
from ..comm.row_exchange import chunk_rows, exchange_rows
from .sharding import shard_tensor


def _tp_module(model: nn.Module, fn: str) -> nn.Module:
    inner = model
    while True:
        if getattr(inner, "_pynccl_zero_model", False):      # pynccl.FullyShardedDataParallel (zero/fsdp.py)
            raise TypeError(f"{fn}: the tensor-parallel model is inside pynccl.FullyShardedDataParallel; sharded "
                            f"checkpoints of ZeRO × TP are not supported (use tp.unsharded_state_dict for a full one)")
        child = getattr(inner, "module", None)
        if not isinstance(child, nn.Module):
            return inner
        inner = child


def tp_specs(module: nn.Module) -> Dict[str, Tuple[int, int]]:
    """{state-dict key: (shard dim, fused blocks)} of the TP-sharded parameters (every name of a tied one)."""
    return {n: (p.tp_shard_dim, p.tp_num_chunks) for n, p in module.named_parameters(remove_duplicate=False)
            if getattr(p, "tp_shard_dim", None) is not None}


def _fused_rows(global_rows: int, num_chunks: int, tp_size: int):
    """Per TP rank, the rows (along the shard dim) its fused slice [q_r | k_r | ...] holds."""
    block, piece = global_rows // num_chunks, global_rows // num_chunks // tp_size
    return [[range(c * block + r * piece, c * block + (r + 1) * piece) for c in range(num_chunks)]
            for r in range(tp_size)]


def _regroup(local: torch.Tensor, dim: int, global_rows: int, num_chunks: int, group, to_fused: bool):
    """Along `dim`, this rank's fused rows -> its torch.chunk rows (or back with to_fused). Collective."""
    tp_size = dist.get_world_size(group)
    fused = _fused_rows(global_rows, num_chunks, tp_size)
    even = [[chunk_rows(global_rows, tp_size, r)] for r in range(tp_size)]
    rows = local.movedim(dim, 0).contiguous()
    src, dst = (even, fused) if to_fused else (fused, even)
    out, = exchange_rows(group, [rows], [tuple(rows.shape[1:])], [src], [dst])
    return out.movedim(0, dim).contiguous()


def _to_global(key: str, local: torch.Tensor, spec, group, mesh) -> DTensor:
    dim, num_chunks = spec
    shape = list(local.shape)
    shape[dim] *= dist.get_world_size(group)
    if num_chunks > 1:
        local = _regroup(local, dim, shape[dim], num_chunks, group, to_fused=False)
    return to_dtensor(local, torch.Size(shape), mesh, dim)


def _to_local(key: str, value, spec, local_shape: torch.Size, group) -> torch.Tensor:
    """This rank's TP slice of a state-dict value: a Shard(dim) DTensor over the TP ranks (used
    as is; fused: regrouped), any other DTensor (made whole), or a whole tensor."""
    dim, num_chunks = spec
    tp_size, rank = dist.get_world_size(group), dist.get_rank(group)
    global_rows = local_shape[dim] * tp_size
    expected = list(local_shape)
    expected[dim] = global_rows
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"'{key}' has shape {tuple(value.shape)}, expected {tuple(expected)} (this rank's "
                         f"{tuple(local_shape)} × tp {tp_size} on dim {dim})")
    if isinstance(value, DTensor) and tuple(value.placements) == (Shard(dim),) and same_ranks(value.device_mesh, group):
        local = value.to_local()
        return _regroup(local, dim, global_rows, num_chunks, group, to_fused=True) if num_chunks > 1 else local
    return shard_tensor(whole_of(value), dim, rank, tp_size, num_chunks)


# ---------------------------------------------------------------------- model
def sharded_state_dict(model: nn.Module, tp_group=None) -> Dict[str, object]:
    """The TP model's state dict with its sharded parameters as DTensors. Collective over tp_group."""
    module = _tp_module(model, "sharded_state_dict")
    group = dist.get_default_group() if tp_group is None else resolve_group(tp_group)
    specs = tp_specs(module)
    mesh = device_mesh(group)
    out, done = {}, {}
    for key, value in module.state_dict().items():
        spec = specs.get(key)
        if spec is None:
            out[key] = value
            continue
        # Tied names share one DTensor (and one collective).
        out[key] = done.get(id(value)) or done.setdefault(id(value), _to_global(key, value, spec, group, mesh))
    return out


def load_sharded_state_dict(model: nn.Module, state_dict: dict, tp_group=None, strict: bool = True):
    """Load DTensors (sharded_state_dict's, DCP-loaded at any TP size, a ZeRO or FSDP2 model's)
    or whole tensors into the TP model; returns load_state_dict's result. Collective over tp_group."""
    module = _tp_module(model, "load_sharded_state_dict")
    group = dist.get_default_group() if tp_group is None else resolve_group(tp_group)
    specs = tp_specs(module)
    own = module.state_dict()
    local = {}
    for key, value in state_dict.items():
        if key in specs and key in own:
            local[key] = _to_local(key, value, specs[key], own[key].shape, group)
        else:
            local[key] = whole_of(value) if isinstance(value, torch.Tensor) else value
    return module.load_state_dict(local, strict=strict)


# ---------------------------------------------------------------------- optimizer
def sharded_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, tp_group=None) -> dict:
    """torch's get_optimizer_state_dict of the TP model (keyed by parameter name), with the
    per-element state of sharded parameters as DTensors. Collective over tp_group."""
    module = _tp_module(model, "sharded_optim_state_dict")
    group = dist.get_default_group() if tp_group is None else resolve_group(tp_group)
    specs = tp_specs(module)
    params = dict(module.named_parameters())
    mesh = device_mesh(group)
    osd = tsd.get_optimizer_state_dict(module, optimizer)
    for name, st in osd["state"].items():
        spec, p = specs.get(name), params.get(name)
        if spec is None or p is None:
            continue
        for key, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.shape == p.shape and not (v.dim() == 0 and key == "step"):
                st[key] = _to_global(f"{name}.{key}", v, spec, group, mesh)
    return osd


def load_sharded_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state_dict: dict,
                                  tp_group=None) -> None:
    """Load sharded_optim_state_dict's form (or a DCP-loaded one at another TP size). Collective."""
    module = _tp_module(model, "load_sharded_optim_state_dict")
    group = dist.get_default_group() if tp_group is None else resolve_group(tp_group)
    specs = tp_specs(module)
    params = dict(module.named_parameters())
    state = {}
    for name, st in optim_state_dict["state"].items():
        spec, p = specs.get(name), params.get(name)
        state[name] = {key: _to_local(f"{name}.{key}", v, spec, p.shape, group)
                       if spec is not None and p is not None and isinstance(v, torch.Tensor) and v.dim() == p.dim()
                       and not (v.dim() == 0 and key == "step") else (whole_of(v) if isinstance(v, torch.Tensor) else v)
                       for key, v in st.items()}
    tsd.set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": optim_state_dict["param_groups"]})


__all__ = ["sharded_state_dict", "load_sharded_state_dict", "sharded_optim_state_dict",
           "load_sharded_optim_state_dict"]
