"""The data-parallel groups of a sharded model: the shard group that parameters, gradients and
optimizer state are cut across, and, for hybrid sharding, the replicate group across which
whole copies of those shards are kept (torch FSDP's HYBRID_SHARD, FSDP2's 2-D mesh, DeepSpeed's
hpZ). Shard within a node, replicate across nodes: the gathers and reduce-scatters stay on NVLink
and only one all-reduce of a 1/shard-sized gradient per unit crosses the network.

Accepted forms, as torch takes them: process_group=(shard_group, replicate_group) (FSDP1);
mesh=ParallelMesh with dp_shard (its dp_shard_group, dp_replicate_group); mesh=torch DeviceMesh,
1-D (shard) or 2-D with dims (replicate, shard) (FSDP2's fully_shard(mesh=...)).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..comm import distributed as dist
from ..comm.coalesced import broadcast_from_rank0
from ..comm.groups import resolve_group
from ..comm.reduce_op import ReduceOp


def resolve_dp_groups(process_group, mesh) -> Tuple[object, Optional[object]]:
    """(shard group, replicate group or None) from FullyShardedDataParallel's arguments."""
    if mesh is not None and process_group is not None:
        raise ValueError("FullyShardedDataParallel: give process_group or mesh, not both")
    if mesh is not None:
        shard, replicate = _groups_of_mesh(mesh)
    elif isinstance(process_group, (tuple, list)):
        if len(process_group) != 2:
            raise ValueError(f"FullyShardedDataParallel: a hybrid process_group is (shard_group, replicate_group), "
                             f"got {len(process_group)} groups")
        shard, replicate = process_group
    else:
        shard, replicate = (dist.get_default_group() if process_group is None else process_group), None
    shard = resolve_group(shard)
    replicate = None if replicate is None else resolve_group(replicate)
    if replicate is not None and replicate.world_size == 1:
        replicate = None
    if replicate is not None:
        _check_grid(shard, replicate)
    return shard, replicate


def _groups_of_mesh(mesh):
    from ..mesh import ParallelMesh
    if isinstance(mesh, ParallelMesh):
        return mesh.dp_shard_group, mesh.dp_replicate_group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:                                # a torch without DeviceMesh
        DeviceMesh = ()
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim == 1:
            return mesh.get_group(0), None
        if mesh.ndim == 2:                             # FSDP2's HSDP: dim 0 replicates, dim 1 shards
            return mesh.get_group(1), mesh.get_group(0)
        raise ValueError(f"FullyShardedDataParallel: a DeviceMesh for data parallelism has 1 (shard) or 2 "
                         f"(replicate, shard) dimensions, got {mesh.ndim}: {mesh}")
    raise TypeError(f"FullyShardedDataParallel: mesh must be a pynccl.ParallelMesh or a torch DeviceMesh, "
                    f"got {type(mesh).__name__}")


def _check_grid(shard, replicate) -> None:
    """The two groups must form a grid: this rank is their only common member, and every replica
    holds the same shard (the same shard rank of shard groups of one size). Collective over the
    replicate group."""
    me = dist.get_rank()
    common = sorted(set(shard.ranks) & set(replicate.ranks))
    if common != [me]:
        raise ValueError(f"FullyShardedDataParallel: the shard group (ranks {shard.ranks}) and the replicate group "
                         f"(ranks {replicate.ranks}) must have only this rank ({me}) in common, they share {common}")
    mine = (shard.rank, shard.world_size)
    seen = [None] * replicate.world_size
    dist.all_gather_object(seen, mine, group=replicate)
    if any(tuple(s) != mine for s in seen):
        raise ValueError(f"FullyShardedDataParallel: every rank of a replicate group must hold the same shard: "
                         f"(shard rank, shard group size) along replicate group {replicate.ranks} is {seen}")


def broadcast_to_replicas(replicate, tensors) -> None:
    """Give every replica the first replica's values (after each shard group agreed on its own)."""
    if replicate is not None and tensors:
        broadcast_from_rank0(replicate.backend, list(tensors))


def agree(ok: bool, device, shard, replicate) -> bool:
    """True on every rank of the shard × replicate grid iff `ok` is true on every one (collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    for group in (shard, replicate):
        if group is not None:
            dist.all_reduce(flag, op=ReduceOp.MIN, group=group)
    return bool(flag.item())
