"""ZeRO-3's gather walks: the fixed order in which blocks are all-gathered, forward and backward,
and what happens to the blocks a rank's walk passes over without running (stage3.py's docstring).

An all-gather is a collective, so every rank starts the same blocks' gathers in the same order,
even where a conditional branch skips a block on some ranks: gathers follow the walk, not the
hooks. A block the walk passes over is gathered anyway (to match the other ranks); forward frees
it at once, backward moves it out of the gather ring first (gather_ring.py: the ring's slot
decisions must be the same on every rank, so a skipping rank gives a slot back no later than
the ranks that run the block).

GatherWalk is a mixin of stage3.ShardedParamsRuntime, which provides _blocks (the gather order),
the cursors _fwd / _bwd (next block to gather), _fwd_touched / _bwd_touched (blocks used),
_fwd_passed / _bwd_passed (how far the passed-over check got), _by_storage, _start_gather and _free.
"""
from __future__ import annotations

from typing import List, Optional

from .flat_unit import ShardedUnit


class GatherWalk:
    """Forward walks the non-root units by ascending index, backward by descending index; a model
    that runs its blocks in order gathers each once (see the module docstring)."""

    @property
    def forward_order(self) -> List[ShardedUnit]:
        return self._blocks

    def _forward_gather_to(self, pos: int, free_passed: bool) -> None:
        """Start the gathers of blocks [cursor, pos]; with free_passed, free those before pos
        (skipped by this rank's forward: gathered only to match the other ranks)."""
        while self._fwd <= min(pos, len(self._blocks) - 1):
            unit = self._blocks[self._fwd]
            self._start_gather(unit)
            if free_passed and self._fwd < pos:
                self._free(unit)
            self._fwd += 1

    def _backward_gather_to(self, pos: int, passed_above: Optional[int] = None) -> None:
        """Start the gathers of blocks [pos, cursor], descending (passed-over ones stay gathered
        until the end of backward: their memory is freed there). passed_above=p: the blocks above
        p gathered here were skipped by this rank's backward; each leaves the gather ring as soon
        as its gather starts, before the next one takes a slot, as the ranks that run it have
        given its slot back by then (gather_ring.py: a slot freed late here would make this rank
        spill where they do not, and pair different all-gather kernels: a hang)."""
        while self._bwd >= max(pos, 0):
            unit = self._blocks[self._bwd]
            self._start_gather(unit)
            if passed_above is not None and self._bwd > passed_above and unit.index not in self._bwd_touched:
                self._leave_ring(unit)
            self._bwd -= 1

    def _backward_reach(self, pos: int, unit: Optional[ShardedUnit] = None) -> None:
        """Backward reached block `pos` (`unit`; pos -1 and no unit: the end of backward). Blocks
        passed over since the last call leave the ring first, then the walk gathers down to pos,
        each skipped block leaving the ring as its gather starts (see _backward_gather_to)."""
        if unit is not None:
            self._bwd_touched.add(unit.index)
        self._release_passed(pos, backward=True)
        self._backward_gather_to(pos, passed_above=pos)

    def _leave_passed(self, unit: ShardedUnit, pos: int, backward: bool) -> None:
        """Forward (backward) reached block `pos`: blocks before it in that walk that it never
        used were skipped by this rank (other ranks may run them). A skipped block that was
        already gathered (prefetched) stays gathered as before, but out of the gather ring (a
        copy), so it holds no slot longer here than on the ranks that run it and every rank
        keeps taking the same slots (gather_ring.py)."""
        (self._bwd_touched if backward else self._fwd_touched).add(unit.index)
        self._release_passed(pos, backward)

    def _release_passed(self, pos: int, backward: bool) -> None:
        """The walk's blocks between its cursor and `pos` (exclusive) that it did not use leave the
        ring (see _leave_passed); pos may be one past either end (the end of the walk)."""
        touched = self._bwd_touched if backward else self._fwd_touched
        step = -1 if backward else 1
        cursor = self._bwd_passed if backward else self._fwd_passed
        while (cursor - pos) * step < 0:
            passed = self._blocks[cursor]
            if passed.index not in touched:
                self._leave_ring(passed)
            cursor += step
        if backward:
            self._bwd_passed = cursor
        else:
            self._fwd_passed = cursor

    def _leave_ring(self, unit: ShardedUnit) -> None:
        if unit.ring_slot is not None:
            unit.leave_ring()
            self._by_storage[unit.full.untyped_storage().data_ptr()] = unit
