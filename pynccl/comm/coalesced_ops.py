"""torch's coalesced collectives: all_reduce_coalesced as one flat all-reduce per dtype.

Many small tensors cost one collective per dtype instead of one each: they are copied into a flat
buffer, reduced, and copied back. all_gather_coalesced is deprecated in torch and not offered.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .backends.base import Work
from .groups import resolve_group
from .reduce_op import ReduceOp, as_reduce_op
from .work_future import remember


class CoalescedWork(Work):
    """The per-dtype all-reduces; wait() waits for them (the current stream on CUDA, the host on
    gloo), then copies the results back into the caller's tensors (ordered after the reduces)."""

    def __init__(self, works: List, flats: List[torch.Tensor], targets: List[List[torch.Tensor]]):
        self._works = works
        self._flats = flats
        self._targets = targets
        self._done = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._done:
            return True
        for w in self._works:
            w.wait()
        for flat, tensors in zip(self._flats, self._targets):
            for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(chunk.view_as(t))
        self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether the reduces have finished; the tensors hold the results after wait()."""
        return self._done or all(w.is_completed() for w in self._works)


def all_reduce_coalesced(tensors: List[torch.Tensor], op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch.distributed.all_reduce_coalesced: reduce every tensor of `tensors` in place, with one
    all-reduce per dtype (in order of first appearance, the same on every rank)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("all_reduce_coalesced: tensors must be a non-empty list of tensors")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce_coalesced: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device != tensors[0].device:
            raise ValueError(f"all_reduce_coalesced: tensors[{i}] is on {t.device}, tensors[0] on "
                             f"{tensors[0].device}; all must be on one device")
    op = as_reduce_op(op, "all_reduce_coalesced")
    g = resolve_group(group)
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    works, flats, targets = [], [], []
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        works.append(g.backend.all_reduce(flat, op, True))
        flats.append(flat)
        targets.append(group_tensors)
    work = CoalescedWork(works, flats, targets)
    if not async_op:
        work.wait()
        return None
    remember(work, list(tensors))
    return work


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op: bool = False):
    raise NotImplementedError("all_gather_coalesced is deprecated in torch and not offered by pynccl: flatten the "
                              "inputs into one tensor (torch.cat of the reshaped inputs) and call "
                              "pynccl.all_gather_into_tensor once, or call pynccl.all_gather per tensor")
