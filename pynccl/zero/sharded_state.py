"""Sharded state dicts of a ZeRO model and its optimizer as torch DTensors, FSDP2's form: each
parameter (and each per-element optimizer state) a DTensor with Shard(0) over a 1-D DeviceMesh
of the ZeRO group, keyed by the parameter's original name; torch.distributed.checkpoint (DCP)
saves and loads them as it does FSDP2's, at any world size.

Why re-slice instead of handing out the shards as they are: ZeRO's flat shards cut parameters
wherever equal shards of the whole unit fall (layout.py), while DTensor's Shard(0), and the
offsets DCP computes from it, are torch.chunk's even row chunks. DCP could describe arbitrary
chunks (ShardedTensor, or a custom planner), but then the state dict would not be what FSDP2
users hold: their code (and FSDP2's load_state_dict) takes Shard(0) DTensors. So rows move
between the two layouts with one all_to_all per unit and state key (row_exchange.py): each rank
sends and receives about its own shard, so nothing bigger than a shard is ever allocated.

A 0-d parameter sits whole on one rank: it becomes a Replicate() DTensor. Frozen parameters are
whole on every rank: their Shard(0) chunk is a view, no communication.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..comm import distributed as dist
from ..comm.dtensor_state import device_mesh, same_ranks, to_dtensor, whole_of  # noqa: F401 - re-exported
from .row_exchange import chunk_rows, exchange_rows, flat_rows


def _even_rows(shape: torch.Size, ws: int) -> List[List[range]]:
    """Per rank, the rows it holds in the DTensor layout (a 0-d tensor: every rank, whole)."""
    if len(shape) == 0:
        return [[range(0, 1)] for _ in range(ws)]
    return [[chunk_rows(shape[0], ws, r)] for r in range(ws)]


def _row_shape(shape: torch.Size) -> tuple:
    return tuple(shape[1:]) if len(shape) > 1 else ()


# ---------------------------------------------------------------------- shards -> DTensors
def unit_to_dtensors(unit, locals_: Dict[int, torch.Tensor], mesh: DeviceMesh) -> Dict[int, DTensor]:
    """{slot: this rank's flat-layout rows} of some of `unit`'s slots -> {slot: DTensor Shard(0)}.
    Collective over the unit's group: every rank passes the same slots."""
    group, layout = unit.group, unit.layout
    ws = dist.get_world_size(group)
    slots = sorted(locals_)
    held = [flat_rows(layout, r) for r in range(ws)]          # held[r][slot]
    shapes = [layout.slots[i].shape for i in slots]
    chunks = exchange_rows(group, [locals_[i] for i in slots], [_row_shape(s) for s in shapes],
                           [[[held[r][i]] for r in range(ws)] for i in slots],
                           [_even_rows(s, ws) for s in shapes])
    return {i: to_dtensor(c, s, mesh) for i, c, s in zip(slots, chunks, shapes)}


def whole_to_dtensor(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A tensor every rank holds whole (a frozen parameter) -> its DTensor (a view of its chunk)."""
    ws, rank = mesh.size(), mesh.get_local_rank()
    if t.dim() == 0:
        return to_dtensor(t, t.shape, mesh)
    rows = chunk_rows(t.shape[0], ws, rank)
    return to_dtensor(t[rows.start: rows.stop], t.shape, mesh)


# ---------------------------------------------------------------------- values -> this rank's chunk
def chunk_of(value, shape: torch.Size, group, what: str) -> torch.Tensor:
    """This rank's torch.chunk rows of a state-dict value for a `shape` tensor: a DTensor (ours,
    FSDP2's, DCP-loaded: Shard(0) over these ranks is used as is; any other layout is made whole
    first) or a plain full tensor (a consolidated or Hugging Face state dict). 0-d: (1,)."""
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{what} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(value, DTensor):
        if len(shape) and tuple(value.placements) == (Shard(0),) and same_ranks(value.device_mesh, group):
            return value.to_local()
        if all(p.is_replicate() for p in value.placements):
            value = value.to_local()
        else:
            value = value.full_tensor()                      # NOTE: collective over the value's mesh
    if len(shape) == 0:
        return value.reshape(1)
    rows = chunk_rows(shape[0], ws, rank)
    return value[rows.start: rows.stop]


# ---------------------------------------------------------------------- DTensor chunks -> shards
def _local_shape(shape: torch.Size, rows: range) -> tuple:
    """Shape of a rank's flat-layout rows of a `shape` parameter, as FlatLayout.local_views gives it."""
    if len(shape) == 0:
        return () if len(rows) else (0,)
    return (len(rows),) + tuple(shape[1:])


def chunks_to_unit(unit, chunks: Dict[int, torch.Tensor], dtype: torch.dtype) -> Dict[int, torch.Tensor]:
    """{slot: this rank's torch.chunk rows} (chunk_of) -> {slot: this rank's flat-layout rows in
    `dtype`, shaped as the unit's local views}. Collective over the unit's group: same slots everywhere."""
    group, layout = unit.group, unit.layout
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    slots = sorted(chunks)
    held = [flat_rows(layout, r) for r in range(ws)]
    shapes = [layout.slots[i].shape for i in slots]
    # A 0-d parameter is replicated in the DTensor layout: its holder supplies itself.
    src = [[[held[r][i]] for r in range(ws)] if len(s) == 0 else _even_rows(s, ws) for i, s in zip(slots, shapes)]
    dst = [[[held[r][i]] for r in range(ws)] for i in slots]
    sources = []
    for i, s in zip(slots, shapes):
        c = chunks[i].reshape(-1)
        if len(s) == 0 and not len(held[rank][i]):
            c = c[:0]                                        # held elsewhere: nothing to supply
        sources.append(c.to(device=unit.shard.device, dtype=dtype))
    flat = exchange_rows(group, sources, [_row_shape(s) for s in shapes], src, dst)
    return {i: f.view(_local_shape(s, held[rank][i])) for i, f, s in zip(slots, flat, shapes)}
