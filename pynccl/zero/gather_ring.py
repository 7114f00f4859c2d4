"""ZeRO-3's ring of gather slots in one NCCL symmetric window (issue 26).

An all-gather whose send and receive buffers lie in a symmetric window runs on the copy engines
(CTAPolicy ZERO, NCCL >= 2.28) and holds no SM beside the GEMMs. A window is registered
collectively, so stage 3 cannot allocate one per gather: it registers one window once, at wrap
time, cut into `R` slots of the largest unit's gathered bytes, and a unit's full buffer is a
view of a slot while it is gathered.

Which slot, decided without communication: the n-th gather (counted on this ring, every gather
of every ring unit counts) takes slot n mod R. If that slot's occupant is still gathered, the
gather takes an ordinary buffer instead ("spilled"): never a wait (the occupant is in use on
this rank) and never an eviction (raw views of it may still be alive, e.g. a tensor autograd
just unpacked).

NOTE: a symmetric all-gather where one rank's buffer is in the window and another's is not pairs
different kernels: a hang. The decision above depends only on this rank's sequence of gathers
and frees. Gathers are collectives, so they come in the same order on every rank; frees come in
the same order wherever every rank runs the same blocks. They differ where a rank skips a block
(stage3.py: a block its forward skipped is freed at once, one its backward skipped is held to the
end of backward). An early free can only turn "spilled" into "slot" on that rank, and a late one
the reverse, so decisions stay equal as long as no rank finds a slot taken: R exceeds the units
gathered at once (GATHER_SLOTS). PYNCCL_CHECK_COLLECTIVES=1 compares every decision
across ranks (the all-gather's signature carries it) and names the first that differs.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch

from ..comm.symmetric import alloc_symmetric, symmetric_support

# PYNCCL_ZERO3_SYMMETRIC unset: whether blocks gather into a ring of symmetric-window slots
# (GatherRing below) where symmetric_support says the group can.
ZERO3_SYMMETRIC_DEFAULT = True
# Slots in that ring. Gathered at once: forward holds the running block and the prefetched one,
# backward the running one and the prefetched one (the one before is freed by its gradient hook
# before the next gather; activation checkpointing holds the recomputed one instead): with 2 slots
# the CPU tests (tests/test_zero3_ring.py) never find one taken, skipped blocks included. One
# slot more as a margin (see the module docstring for why a taken slot matters).
GATHER_SLOTS = 3


class GatherRing:
    """Slot bookkeeping of one window: `slots` are equal byte buffers (uint8, one storage), or
    ordinary tensors standing in for them (tests). Owners are opaque (ShardedUnits)."""

    def __init__(self, slots: List[torch.Tensor]):
        if not slots:
            raise ValueError("GatherRing: expected at least one slot, got none")
        sizes = {s.numel() for s in slots}
        if len(sizes) != 1 or any(s.dtype != torch.uint8 for s in slots):
            raise ValueError(f"GatherRing: expected equal uint8 slots, got {[(s.numel(), s.dtype) for s in slots]}")
        self.slots = slots
        self.slot_bytes = sizes.pop()
        self.occupants: List[Optional[object]] = [None] * len(slots)
        self.gathers = 0                   # gathers counted so far: the next takes slot gathers % R
        self.spilled = 0                   # of them, how many found their slot taken
        self.log: Optional[List[Optional[int]]] = None    # tests: the slot of each gather, None if spilled
        self._storage = slots[0].untyped_storage().data_ptr()
        self._offsets = [s.storage_offset() for s in slots]

    def __len__(self) -> int:
        return len(self.slots)

    def acquire(self, owner, nbytes: int) -> Optional[int]:
        """Count one gather by `owner` (call it exactly once per all-gather, on every rank) and
        hand it slot gathers % R, or None (an ordinary buffer) where that slot is still taken."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"GatherRing: a gather of {nbytes} bytes does not fit a slot of {self.slot_bytes}")
        s = self.gathers % len(self.slots)
        self.gathers += 1
        if self.occupants[s] is not None:
            self.spilled += 1
            s = None
        else:
            self.occupants[s] = owner
        if self.log is not None:
            self.log.append(s)
        return s

    def count_in_place(self) -> None:
        """Count a gather that needs no buffer (its owner kept one): the numbering stays the
        number of all-gathers, the same on every rank."""
        self.gathers += 1
        if self.log is not None:
            self.log.append(-1)

    def release(self, owner, s: int) -> None:
        if self.occupants[s] is not owner:
            raise RuntimeError(f"GatherRing: slot {s} is held by {self.occupants[s]!r}, not by {owner!r}")
        self.occupants[s] = None

    def view(self, s: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `nbytes` of slot s as a 1-D tensor of dtype (slots start 4096-aligned: any
        dtype's view is aligned)."""
        return self.slots[s][:nbytes].view(dtype)

    def owner_at(self, t: torch.Tensor, storage_ptr: Optional[int] = None):
        """The owner of the slot `t` lies in, or None (t is not in this ring's memory).
        storage_ptr: t.untyped_storage().data_ptr() where the caller has it already."""
        if (t.untyped_storage().data_ptr() if storage_ptr is None else storage_ptr) != self._storage:
            return None
        byte = t.storage_offset() * t.element_size()
        for s, start in enumerate(self._offsets):
            if start <= byte < start + self.slot_bytes:
                return self.occupants[s]
        return None


def build_gather_ring(blocks, group):
    """Collective (same layout on every rank): (GatherRing, "") with GATHER_SLOTS slots of the
    largest block's (ShardedUnit's) gathered bytes in one symmetric window, or (None, why not)."""
    env = os.environ.get("PYNCCL_ZERO3_SYMMETRIC", "").strip().lower()
    if env in ("0", "false", "off", "no") or (not env and not ZERO3_SYMMETRIC_DEFAULT):
        return None, "off (PYNCCL_ZERO3_SYMMETRIC)"
    if not blocks or group.world_size == 1:
        return None, "off (no block units to gather)" if not blocks else "off (one rank)"
    support = symmetric_support(group)
    if not support.available:
        return None, support.describe()
    slot_bytes = max(u.layout.padded_numel * u.full.element_size() for u in blocks)
    slots = alloc_symmetric(group, [(slot_bytes, torch.uint8)] * GATHER_SLOTS)
    if slots is None:                                 # the same on every rank; the group says why
        return None, symmetric_support(group).describe()
    return GatherRing(slots), ""
