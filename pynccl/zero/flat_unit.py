"""A sharded unit: one FlatLayout's worth of parameters. Between steps it is only this rank's
master shard (the nn.Parameter the optimizer sees); a forward or backward that needs the
parameters all-gathers them into a full flat buffer in the compute dtype.

All of ZeRO's communication goes through gather / free / reduce_grad here, so the stages
differ only in *when* they call them (stage12.py, stage3.py).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from ..comm import distributed as dist
from ..comm.reduce_op import ReduceOp
from .layout import FlatLayout


class PendingReduce:
    """A gradient reduce-scatter in flight; `inp` stays referenced until it completes."""

    __slots__ = ("unit", "work", "out", "inp")

    def __init__(self, unit: "ShardedUnit", work, out: torch.Tensor, inp: torch.Tensor):
        self.unit, self.work, self.out, self.inp = unit, work, out, inp


class ReduceQueue:
    """Gradient reduce-scatters in flight, oldest first, at most `limit` at a time once trimmed:
    trim() finishes the oldest ones (their buffers are freed), so a rank never holds more than
    `limit` reduce buffers besides its shards, plus the one just started."""

    def __init__(self, limit: int):
        self.limit = limit
        self.pending: List[PendingReduce] = []

    def append(self, pending: PendingReduce) -> None:
        self.pending.append(pending)

    def trim(self, keep: Optional[int] = None) -> None:
        """Finish the oldest until at most `keep` (default: the limit) remain."""
        keep = self.limit if keep is None else keep
        while len(self.pending) > keep:
            p = self.pending.pop(0)
            p.unit.finish_reduce(p)

    def drain(self) -> None:
        self.trim(0)

    def buffers(self) -> List[torch.Tensor]:
        """The input and output buffers in flight (for memory accounting)."""
        return [t for p in self.pending for t in (p.inp, p.out)]


class ShardedUnit:
    """Master shard + full compute buffer of one flat layout, and the collectives on them.

    persistent=True (stages 1, 2): the full buffer lives for the whole run; when no cast is
    needed the master shard is a view of it (no second copy). persistent=False (stage 3):
    the buffer's storage is allocated for a gather and resized to 0 by free(); `full` is a
    leaf that requires grad, so autograd sums every parameter's gradient into full.grad.
    """

    def __init__(self, index: int, layout: FlatLayout, params: Sequence[torch.Tensor], group,
                 compute_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype], *,
                 persistent: bool, sync_from_first_rank: bool):
        master_dtype = params[0].dtype
        for slot, p in zip(layout.slots, params):
            if p.dtype != master_dtype:
                raise TypeError(f"FullyShardedDataParallel: parameters sharded together must share a dtype; "
                                f"'{layout.slots[0].name}' is {master_dtype} but '{slot.name}' is {p.dtype}")
        self.index = index
        self.layout = layout
        self.group = group
        self.backend = group.backend
        self.rank = group.rank
        self.master_dtype = master_dtype
        self.compute_dtype = compute_dtype or master_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.persistent = persistent
        device = params[0].device
        k = layout.shard_numel
        with torch.no_grad():
            flat = torch.zeros(layout.padded_numel, dtype=master_dtype, device=device)
            self.backend.pack([p.detach().contiguous() for p in params], flat[: layout.numel])
            if sync_from_first_rank and group.world_size > 1:
                dist.broadcast(flat, src=group.ranks[0], group=group)
            mine = flat[self.rank * k: (self.rank + 1) * k]
            self.alias = persistent and self.compute_dtype == master_dtype
            if self.alias:
                full, shard = flat, mine
            else:
                shard = mine.clone()
                full = flat.to(self.compute_dtype) if persistent else torch.empty(
                    layout.padded_numel, dtype=self.compute_dtype, device=device)
            del flat, mine
        self.shard = nn.Parameter(shard)
        self.full = full                               # (padded_numel,) in compute dtype
        self._full_nbytes = full.untyped_storage().nbytes()
        self.gather_work = None
        if persistent:
            self.gathered_version = self.shard._version
        else:
            self.gathered_version = -1
            self.full.untyped_storage().resize_(0)
            self.full.requires_grad_(True)

    # ------------------------------------------------------------------ parameters
    @property
    def is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def is_current(self) -> bool:
        """The full buffer holds the current shards of every rank (no gather needed)."""
        return self.gather_work is None and self.is_allocated and self.gathered_version == self.shard._version

    def gather(self) -> None:
        """Start the all-gather of every rank's shard into `full` (async: wait_gather() before use).

        The shard is first cast into its own slot of the buffer (backend.pack, fused cast),
        then gathered in place, so no staging copy is allocated."""
        if self.gather_work is not None:
            return
        if not self.is_allocated:
            self.full.untyped_storage().resize_(self._full_nbytes)
        k = self.layout.shard_numel
        with torch.no_grad():
            full = self.full.detach()
            slot = full[self.rank * k: (self.rank + 1) * k]
            if not self.alias:
                self.backend.pack([self.shard.detach()], slot)
            self.gather_work = dist.all_gather_into_tensor(full, slot, group=self.group, async_op=True)

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None
            # NOTE: read after the gather: with an aliased shard the gather itself bumps the version.
            self.gathered_version = self.shard._version

    def ensure_current(self) -> None:
        if not self.is_current:
            self.gather()
            self.wait_gather()

    def free(self) -> None:
        """Release the full buffer's memory (stage 3); a no-op for persistent buffers."""
        self.wait_gather()                             # never free memory a gather still writes
        if not self.persistent and self.is_allocated:
            self.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ gradients
    def reduce_grad(self, grads: List[Optional[torch.Tensor]]) -> PendingReduce:
        """Start averaging `grads` over the group into this rank's shard.

        grads: either one per slot (parameter-shaped; None counts as zero), or a single flat
        (padded_numel,) tensor that this unit owns (stage 3's full.grad)."""
        L = self.layout
        device = self.full.device
        with torch.no_grad():
            flat_given = len(grads) == 1 and grads[0] is not None and grads[0].numel() == L.padded_numel
            if flat_given and grads[0].dtype == self.reduce_dtype:
                inp = grads[0].view(-1)
            else:
                inp = torch.empty(L.padded_numel, dtype=self.reduce_dtype, device=device)
                if flat_given:
                    self.backend.pack(grads, inp)
                else:
                    # NOTE: one pack call takes one dtype: stand-ins for missing grads match the others.
                    tensors = [g if g is not None else torch.zeros(s.shape, dtype=self.compute_dtype, device=device)
                               for g, s in zip(grads, L.slots)]
                    self.backend.pack(tensors, inp[: L.numel])
                    inp[L.numel:].zero_()
            out = torch.empty(L.shard_numel, dtype=self.reduce_dtype, device=device)
            work = dist.reduce_scatter_tensor(out, inp, op=ReduceOp.AVG, group=self.group, async_op=True)
        return PendingReduce(self, work, out, inp)

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for `pending` and add its result to shard.grad (in the master dtype)."""
        pending.work.wait()
        # The input is spent once the reduce-scatter is done: free it before the cast allocates.
        pending.inp = None
        with torch.no_grad():
            g = pending.out if pending.out.dtype == self.master_dtype else pending.out.to(self.master_dtype)
            if self.shard.grad is None:
                self.shard.grad = g
            else:
                self.shard.grad.add_(g)
        pending.inp = pending.out = None

    def __repr__(self):
        return (f"ShardedUnit({self.index}, {self.layout}, compute={self.compute_dtype}, "
                f"reduce={self.reduce_dtype}, persistent={self.persistent})")
