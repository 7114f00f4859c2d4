"""pynccl groups as torch DTensor meshes, and DTensor values made local or whole: what the sharded
state dicts of ZeRO (zero/sharded_state.py) and tensor parallelism (tensor_parallel/dcp.py) share.
torch.distributed.tensor is imported here, so only those (imported on first use) pay for it."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import distributed as dist

_MESHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def device_mesh(group) -> DeviceMesh:
    """A 1-D DeviceMesh over `group`'s ranks (in group order), on its torch ProcessGroup
    (pynccl.to_torch_group). Made once per group; the first call is collective over it."""
    mesh = _MESHES.get(group)
    if mesh is None:
        mesh = DeviceMesh.from_group(dist.to_torch_group(group), group.backend.device.type)
        _MESHES[group] = mesh
    return mesh


def _contiguous_stride(shape: torch.Size) -> tuple:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def to_dtensor(local: torch.Tensor, shape: torch.Size, mesh: DeviceMesh, dim: int = 0) -> DTensor:
    """Wrap this rank's torch.chunk slice along `dim` of a `shape` tensor (Shard(dim); a 0-d
    tensor whole, Replicate()); no communication."""
    if len(shape) == 0:
        return DTensor.from_local(local.reshape(()), mesh, [Replicate()], run_check=False, shape=torch.Size(()),
                                  stride=())
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def same_ranks(mesh: DeviceMesh, group) -> bool:
    """`mesh` is 1-D over `group`'s ranks in group order (its local tensors are our chunks)."""
    # NOTE: torch's own lookup: pynccl's would map an unseen torch group to a new (collective) pynccl group.
    return mesh.ndim == 1 and tdist.get_process_group_ranks(mesh.get_group()) == dist.get_process_group_ranks(group)


def whole_of(value) -> torch.Tensor:
    """The whole tensor of a state-dict value (collective for a sharded DTensor)."""
    if isinstance(value, DTensor):
        return value.full_tensor() if not all(p.is_replicate() for p in value.placements) else value.to_local()
    return value
