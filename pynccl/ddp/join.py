"""DistributedDataParallel.join(): training on uneven inputs, with torch's Join semantics.

    with ddp.join():
        for batch in my_loader:          # ranks may hold different numbers of batches
            ...forward, backward, step...

A rank still training starts every forward with one small SUM all-reduce (the "notify") of
[1, sync, rebuild, 0, broadcast_buffers, one-hot of its rank]. A rank whose loop has ended
polls with zeros, and while anyone is still training shadows that iteration's collectives in the
same order: the bucket rebuild's broadcast, the buffer broadcast (from the highest rank still
training, whose buffers are current, as torch does), every bucket's reduction with zero gradients
through the same comm hook, and the used-map all-reduce. So gradients are the sum over the ranks
that had data divided by the initial world size (torch's default), or by the number of those ranks
(divide_by_initial_world_size=False; built-in hooks only, as in torch a hook divides itself). When
no rank trains any more, the last rank(s) to join broadcast parameters and buffers to all.
The notify needs a host sync only where its result is read: throw_on_early_termination, a divisor
other than the world size, or buffers to broadcast.
"""
from __future__ import annotations

import torch

from ..comm.coalesced import coalesced_broadcaster
from ..comm.reduce_op import ReduceOp

_ACTIVE, _SYNC, _REBUILD, _TERMINATE, _BUFFERS, _RANKS = range(6)    # the notify vector's slots
_EARLY_TERMINATION = "Detected at least one rank that exhausted inputs. Throwing across all ranks."


class Join:
    """The context manager DistributedDataParallel.join() returns (torch's arguments)."""

    def __init__(self, ddp, divide_by_initial_world_size: bool = True, enable: bool = True,
                 throw_on_early_termination: bool = False):
        if enable and ddp.static_graph:
            raise ValueError("DistributedDataParallel.join: not supported with static_graph=True (its unused "
                             "parameters are learnt from the first iteration, which a joined rank does not run)")
        self.ddp = ddp
        self.backend = ddp.process_group.backend
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.enable = enable
        self.throw = throw_on_early_termination
        self.buffer_src = 0

    def __enter__(self):
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError("DistributedDataParallel.join: already inside a join context of this module")
            self.ddp._join = self
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.enable:
            return False
        self.ddp._join = None
        self.ddp.reducer.set_divisor(None)
        if exc_type is not None:             # as torch: an error inside the loop is not joined
            return False
        is_last_joiner = True
        while True:
            counts = self._all_reduce(self._vector(active=False))
            if counts[_ACTIVE] == 0:
                break
            if self.throw:
                raise RuntimeError(_EARLY_TERMINATION)
            is_last_joiner = False
            self._shadow(counts)
        self._sync_final_model(is_last_joiner)
        return False

    # ------------------------------------------------------------------ ranks still training
    def notify(self, sync: bool, broadcast_buffers: bool) -> None:
        """Called first in every forward of a rank inside the context (DistributedDataParallel.forward)."""
        reducer = self.ddp.reducer
        vec = self._vector(active=True, sync=sync, rebuild=sync and reducer.will_rebuild(),
                           broadcast_buffers=broadcast_buffers)
        need_counts = self.throw or not self.divide_by_initial_world_size or broadcast_buffers
        t = torch.tensor(vec, dtype=torch.int32, device=self.backend.device)
        self.backend.all_reduce(t, ReduceOp.SUM)
        if not need_counts:
            return
        counts = t.tolist()
        if counts[_TERMINATE] > 0:
            raise RuntimeError(_EARLY_TERMINATION)
        self.buffer_src = self._highest_active_rank(counts)
        self.active_ranks = counts[_ACTIVE]

    def after_prepare(self) -> None:
        """After the reducer's prepare_for_forward (which may rebuild buckets and reset the scale)."""
        if not self.divide_by_initial_world_size:
            self.ddp.reducer.set_divisor(self.active_ranks)

    # ------------------------------------------------------------------ ranks that joined
    def _shadow(self, counts) -> None:
        ddp, reducer = self.ddp, self.ddp.reducer
        if counts[_REBUILD] > 0 and not reducer.rebuilt:
            reducer._rebuild_buckets()
        if counts[_BUFFERS] > 0:
            ddp._broadcast_buffers(self._highest_active_rank(counts))
        if counts[_SYNC] > 0:
            reducer.reduce_zeros(None if self.divide_by_initial_world_size else counts[_ACTIVE])

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters (and buffers) of the highest-ranked last joiner."""
        t = torch.tensor([self.backend.rank if is_last_joiner else -1], dtype=torch.int32, device=self.backend.device)
        self.backend.all_reduce(t, ReduceOp.MAX)
        src = int(t.item())
        tensors = [p.detach() for p in self.ddp.module.parameters()]
        if self.ddp.broadcast_buffers:
            tensors += self.ddp._module_buffers
        coalesced_broadcaster(tensors)(self.backend, src)

    # ------------------------------------------------------------------ the notify vector
    def _vector(self, active: bool, sync: bool = False, rebuild: bool = False, broadcast_buffers: bool = False):
        vec = [0] * (_RANKS + self.backend.world_size)
        if active:
            vec[_ACTIVE], vec[_SYNC], vec[_REBUILD], vec[_BUFFERS] = 1, int(sync), int(rebuild), int(broadcast_buffers)
            vec[_RANKS + self.backend.rank] = 1
        else:
            vec[_TERMINATE] = int(self.throw)
        return vec

    def _all_reduce(self, vec):
        t = torch.tensor(vec, dtype=torch.int32, device=self.backend.device)
        self.backend.all_reduce(t, ReduceOp.SUM)
        return t.tolist()

    def _highest_active_rank(self, counts) -> int:
        return max(r for r in range(self.backend.world_size) if counts[_RANKS + r] > 0)
