"""torch DDP's constructor arguments beyond the ones pynccl's DDP has always taken (torch 2.11-2.14's
signature, in its positional order: module.py): what each maps to, or a clear refusal.

* init_sync, broadcast_buffers, forward_sync_buffers: what is broadcast from rank 0 at construction
  and before each forward, as torch decides it (`sync_plan`). broadcast_buffers=False also leaves the
  buffers rank-local at construction; forward_sync_buffers (torch 2.14) replaces it and does not touch
  the construction's sync; init_sync=False syncs nothing there (nor checks the model's shapes).
* device_mesh: a 1-D torch DeviceMesh in place of process_group (its group), never both.
* check_reduction: deprecated and ignored by torch (a FutureWarning there too).
* batched_grad_copy (torch 2.14): a speed hint about torch's per-parameter copies into buckets, which
  pynccl packs in one C++ call per bucket anyway: accepted, no effect on results.
* delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, skip_all_reduce_unused_params,
  bucket_cap_mb_list: not implemented; a non-default value raises (`refuse_unsupported`), never ignored.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    init: bool              # at construction: the model's shapes compared across ranks, rank 0's parameters broadcast
    init_buffers: bool      # rank 0's buffers broadcast at construction
    forward_buffers: bool   # rank 0's buffers broadcast before each forward (DDP.broadcast_buffers)


def sync_plan(broadcast_buffers: Optional[bool], init_sync: bool, forward_sync_buffers: Optional[bool]) -> SyncPlan:
    """torch's choices (DistributedDataParallel.__init__, torch 2.14): forward_sync_buffers wins over
    the deprecated broadcast_buffers for the forward and leaves the construction's buffers synced;
    broadcast_buffers (default True) decides both."""
    for name, value in (("broadcast_buffers", broadcast_buffers), ("forward_sync_buffers", forward_sync_buffers)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"DistributedDataParallel: {name} must be a bool or None, got {value!r}")
    if not isinstance(init_sync, bool):
        raise TypeError(f"DistributedDataParallel: init_sync must be a bool, got {init_sync!r}")
    if forward_sync_buffers is not None:
        forward, init_buffers = forward_sync_buffers, True
    else:
        forward = init_buffers = True if broadcast_buffers is None else broadcast_buffers
    return SyncPlan(init_sync, init_sync and init_buffers, forward)


def group_or_mesh(process_group, device_mesh):
    """What names the group: process_group, or a 1-D torch DeviceMesh (resolve_group takes either)."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("DistributedDataParallel: cannot specify both process_group and device_mesh arguments "
                           "(as torch's DDP)")
    if getattr(device_mesh, "ndim", None) != 1:
        raise RuntimeError(f"DistributedDataParallel: only a 1-D device_mesh is supported (as torch's DDP), got "
                           f"{getattr(device_mesh, 'ndim', type(device_mesh).__name__)} dims")
    return device_mesh


# name -> its default in torch's signature; any other value is refused
_UNSUPPORTED = {"delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None, "mixed_precision": None,
                "skip_all_reduce_unused_params": False, "bucket_cap_mb_list": None}


def refuse_unsupported(check_reduction, **given) -> None:
    """NotImplementedError naming the first of torch's arguments pynccl's DDP does not implement that is
    set; check_reduction warns as torch does and is otherwise ignored."""
    for name, value in given.items():
        default = _UNSUPPORTED[name]
        if value is not default and value != default:
            raise NotImplementedError(
                f"DistributedDataParallel: {name}={value!r} is torch DDP's, which pynccl's DDP does not implement "
                f"(leave it at {default!r}, or use torch.nn.parallel.DistributedDataParallel for it)")
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` is deprecated (by torch) and "
                      "has no effect", FutureWarning, stacklevel=3)
