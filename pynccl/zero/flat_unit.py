"""A sharded unit: one FlatLayout's worth of parameters. Between steps it is only this rank's
flat master shard; the module's own nn.Parameter objects become views of it (this rank's rows
of each, FlatLayout.local_views), so the optimizer updates the shard in place. A forward or
backward that needs the parameters all-gathers them into a full flat buffer in the compute dtype.

All of ZeRO's communication goes through gather / free / reduce_grad here, so the stages
differ only in *when* they call them (stage12.py, stage3.py). With hybrid sharding (hybrid.py) a
reduce is two collectives: the reduce-scatter over the shard group, then an all-reduce of the
shard over the replicate group, started only once the first has finished (advance()).
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Sequence

import torch
from torch import nn

from ..comm import distributed as dist
from ..comm.collective_check import tag_next_collective
from ..comm.reduce_op import ReduceOp
from .gather_ring import GatherRing
from .layout import FlatLayout


class PendingReduce:
    """A gradient reduce in flight; `inp` stays referenced until its reduce-scatter completes.
    `out` is borrowed (a slice of a reused symmetric buffer) when `out_borrowed`: finish_reduce
    copies it. `replicas_left`: the all-reduce across replicas is still to be started (hybrid)."""

    __slots__ = ("unit", "work", "out", "inp", "out_borrowed", "replicas_left")

    def __init__(self, unit: "ShardedUnit", work, out: torch.Tensor, inp: torch.Tensor, out_borrowed: bool = False):
        self.unit, self.work, self.out, self.inp, self.out_borrowed = unit, work, out, inp, out_borrowed
        self.replicas_left = unit.replicate_group is not None

    def advance(self) -> bool:
        """Start the replicas' all-reduce once the reduce-scatter finished (never waits); True
        when the whole reduce has completed."""
        if not self.work.is_completed():
            return False
        if self.replicas_left:
            self.unit.reduce_across_replicas(self)
            return self.work.is_completed()
        return True


class SymmetricReduceRing:
    """Reduce-scatter buffers in one NCCL symmetric window (comm/symmetric.py), reused in turn:
    `size` slots of `numel` elements, so the reduce-scatter runs NCCL's symmetric kernel (a few
    CTAs). NOTE: a slot is reused `size` launches later; the ReduceQueue keeps at most size - 1
    reduces pending, and a reused slot's next pack is stream-ordered after its last reduce."""

    def __init__(self, slots: List[torch.Tensor]):
        self.slots = slots
        self.next = 0

    def take(self, numel: int) -> torch.Tensor:
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        return slot[:numel]


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

    def trim_completed(self) -> None:
        """Finish the oldest while they have completed (never waits: they run in order on one
        stream, so the first one still running ends the scan). NOTE: only the oldest advances to
        its replicas' all-reduce, so those start in queue order, the same on every rank."""
        while self.pending and self.pending[0].advance():
            p = self.pending.pop(0)
            p.unit.finish_reduce(p)

    def drain(self) -> None:
        self.trim(0)

    def buffers(self) -> List[torch.Tensor]:
        """The input and output buffers in flight (for memory accounting)."""
        return [t for p in self.pending for t in (p.inp, p.out) if t is not None]


class ShardedUnit:
    """Master shard + full compute buffer of one flat layout, and the collectives on them.

    persistent=True (stages 1, 2): the full buffer lives for the whole run; when no cast is
    needed the master shard is a view of it (no second copy). persistent=False (stage 3):
    the buffer's storage is allocated for a gather and resized to 0 by free(), or, with a
    gather_ring, `full` is a view of a ring slot from gather to free(); `full` is a leaf that
    requires grad, so autograd sums every parameter's gradient into full.grad.
    """

    def __init__(self, index: int, layout: FlatLayout, params: Sequence[nn.Parameter], group,
                 compute_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype], *,
                 persistent: bool, sync_from_first_rank: bool, reduce_group=None, replicate_group=None,
                 full_buffer: Optional[torch.Tensor] = None, reduce_ring: Optional[SymmetricReduceRing] = None,
                 gather_ring: Optional[GatherRing] = None):
        """params: the module's original parameters, one per slot; each becomes a view of this
        rank's rows of it in the shard (param.data is replaced, the object stays the same).
        replicate_group: hybrid sharding, the groups holding the same shard (hybrid.py).
        full_buffer (persistent units): where `full` lives, (padded_numel,) in the compute dtype,
        e.g. a symmetric window, so its all-gathers run on NCCL's copy engines / symmetric kernels.
        reduce_ring: symmetric buffers the gradient reduce-scatters run in (else fresh tensors).
        gather_ring (stage 3): slots of a symmetric window a gather takes where it can
        (gather_ring.py): `full` is then a view of the slot until free()."""
        master_dtype = params[0].dtype
        for slot, p in zip(layout.slots, params):
            if p.dtype != master_dtype:
                raise TypeError(f"FullyShardedDataParallel: parameters sharded together must share a dtype; "
                                f"'{layout.slots[0].name}' is {master_dtype} but '{slot.name}' is {p.dtype}")
        self.index = index
        self.layout = layout
        self.group = group
        self.reduce_group = group if reduce_group is None else reduce_group   # reduce-scatters run here
        self.replicate_group = replicate_group         # and then all-reduces of the shard, here
        self.backend = group.backend
        self.rank = group.group_rank
        self.master_dtype = master_dtype
        self.compute_dtype = compute_dtype or master_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.persistent = persistent
        self.reduce_ring = reduce_ring
        self.gather_ring = gather_ring
        self.ring_slot: Optional[int] = None          # the gather_ring slot `full` is a view of
        self._zeros = {}                               # dtype -> zeros for the padding (pack_slots)
        device = params[0].device
        k = layout.shard_numel
        with torch.no_grad():
            flat = torch.zeros(layout.padded_numel, dtype=master_dtype, device=device)
            self.pack_slots([p.detach().contiguous() for p in params], flat)
            if sync_from_first_rank and group.world_size > 1:
                dist.broadcast(flat, src=group.ranks[0], group=group)
            if sync_from_first_rank and replicate_group is not None:
                dist.broadcast(flat, src=replicate_group.ranks[0], group=replicate_group)
            mine = flat[self.rank * k: (self.rank + 1) * k]
            self.alias = persistent and self.compute_dtype == master_dtype
            if full_buffer is not None:
                full_buffer.copy_(flat)                # cast where the compute dtype differs
            if self.alias:
                full = flat if full_buffer is None else full_buffer
                shard = full[self.rank * k: (self.rank + 1) * k]
            else:
                shard = mine.clone()
                full = (flat.to(self.compute_dtype) if full_buffer is None else full_buffer) if persistent else \
                    torch.empty(layout.padded_numel, dtype=self.compute_dtype, device=device)
            del flat, mine
        self.shard = shard                             # (shard_numel,) master dtype, this rank's
        self.params = list(params)
        self._views = layout.local_views(self.rank, shard)
        for p, view in zip(self.params, self._views):
            p.grad = None
            p.data = view
            p._pynccl_zero_group = group               # for pynccl.clip_grad_norm_ (clip.py)
        # The flat (shard_numel,) gradient the params' .grad are views of, and those views: weak
        # references (see add_grad).
        self._grad_flat: Optional[weakref.ref] = None
        self._grad_views: List[weakref.ref] = []
        self.full = full                               # (padded_numel,) in compute dtype
        self._full_nbytes = full.untyped_storage().nbytes()
        self.gather_work = None
        self.stale = not persistent                    # full does not hold every rank's current shard
        if not persistent:
            self.full.untyped_storage().resize_(0)
            self.full.requires_grad_(True)
            # The full buffer's own storage (size 0 while freed); `full` points here or at a slot.
            self._own_full = self.full.detach()

    # ------------------------------------------------------------------ parameters
    @property
    def is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    @property
    def is_current(self) -> bool:
        """The full buffer holds the current shards of every rank (no gather needed)."""
        return self.gather_work is None and self.is_allocated and not self.stale

    def check_params(self) -> None:
        """Make sure each parameter still is its view of the shard. An optimizer or script that
        assigned `p.data = new_tensor` broke the alias: copy the new values into the shard and
        point the parameter back at it (a shape change is an error)."""
        for p, view in zip(self.params, self._views):
            if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                if p.shape != view.shape:
                    raise RuntimeError(f"FullyShardedDataParallel: a sharded parameter of unit {self.index} now has "
                                       f"shape {tuple(p.shape)}, expected its shard's {tuple(view.shape)}; parameters "
                                       f"may be updated in place or through p.data, but keep their shape")
                with torch.no_grad():
                    view.copy_(p.data)
                p.data = view

    def gather(self) -> None:
        """Start the all-gather of every rank's shard into `full` (async: wait_gather() before use).

        The shard is first cast into its own slot of the buffer (backend.pack, fused cast),
        then gathered in place, so no staging copy is allocated."""
        if self.gather_work is not None:
            return
        self.check_params()
        if not self.is_allocated:
            self._take_buffer()
        elif self.gather_ring is not None:
            self.gather_ring.count_in_place()
        k = self.layout.shard_numel
        with torch.no_grad():
            full = self.full.detach()
            slot = full[self.rank * k: (self.rank + 1) * k]
            if not self.alias:
                self.backend.pack([self.shard.detach()], slot)
            if self.gather_ring is not None:            # PYNCCL_CHECK_COLLECTIVES compares the ring's decision
                tag_next_collective(self.group.backend, "ring" if self.ring_slot is not None else "ordinary")
            self.gather_work = dist.all_gather_into_tensor(full, slot, group=self.group, async_op=True)

    def _take_buffer(self) -> None:
        """Point `full` at the ring's slot for this gather, else at its own storage, allocated.
        NOTE: `full.data = ...` keeps the leaf (its grad hook, autograd identity); the slot's
        previous occupant was freed on this rank, and its last readers were queued on this
        stream before this gather's pack and all-gather (which waits for this stream)."""
        nbytes = self.layout.padded_numel * self.full.element_size()
        s = self.gather_ring.acquire(self, nbytes) if self.gather_ring is not None else None
        with torch.no_grad():
            if s is not None:
                self.ring_slot = s
                self.full.data = self.gather_ring.view(s, nbytes, self.compute_dtype)
            else:
                self.full.data = self._own_full
                self.full.untyped_storage().resize_(self._full_nbytes)

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None
            self.stale = False

    def free(self) -> None:
        """Release the full buffer's memory (stage 3); a no-op for persistent buffers."""
        self.wait_gather()                             # never free memory a gather still writes
        if not self.persistent and self.is_allocated:
            if self.ring_slot is not None:              # the slot goes back to the ring, the memory stays
                self.gather_ring.release(self, self.ring_slot)
                self.ring_slot = None
                with torch.no_grad():
                    self.full.data = self._own_full
            else:
                self.full.untyped_storage().resize_(0)
            self.stale = True

    def leave_ring(self) -> None:
        """Move the gathered parameters out of their ring slot into this unit's own storage (one
        copy, stream-ordered after the gather) and give the slot back; a no-op outside the ring."""
        if self.ring_slot is None:
            return
        self.wait_gather()
        with torch.no_grad():
            self._own_full.untyped_storage().resize_(self._full_nbytes)
            self._own_full.copy_(self.full.detach())
            self.gather_ring.release(self, self.ring_slot)
            self.ring_slot = None
            self.full.data = self._own_full

    def pack_slots(self, tensors: List[torch.Tensor], flat: torch.Tensor, scale: float = 1.0) -> None:
        """Pack one tensor per slot into `flat` (padded_numel,) at the slots' offsets (x scale),
        zeros in the padding between them: one backend.pack call (on NCCL one fused kernel)."""
        sizes = self.layout.split_sizes
        zeros = self._zeros.get(tensors[0].dtype)
        if zeros is None or zeros.device != tensors[0].device:
            zeros = torch.zeros(max(sizes[0::2]), dtype=tensors[0].dtype, device=tensors[0].device)
            self._zeros[tensors[0].dtype] = zeros
        parts = []
        for gap, t in zip(sizes[0::2], tensors):
            if gap:
                parts.append(zeros[:gap])
            parts.append(t)
        if sizes[-1]:
            parts.append(zeros[: sizes[-1]])
        self.backend.pack(parts, flat, scale)

    # ------------------------------------------------------------------ gradients
    def reduce_grad(self, grads: List[Optional[torch.Tensor]]) -> PendingReduce:
        """Start averaging `grads` over the group into this rank's shard.

        grads: either one per slot (parameter-shaped; None counts as zero), or a single flat
        (padded_numel,) tensor that this unit owns (stage 3's full.grad)."""
        L = self.layout
        device = self.full.device
        with torch.no_grad():
            flat_given = len(grads) == 1 and grads[0] is not None and grads[0].numel() == L.padded_numel
            if self.reduce_ring is not None and not flat_given:
                # In a symmetric window: the 1/N is folded into the pack and the reduce-scatter is an
                # in-place SUM (NCCL's symmetric kernels sum; AVG would leave them). Bit for bit the
                # AVG of the other path: NCCL's float AVG is this premultiplied sum.
                inp = self.reduce_ring.take(L.padded_numel)
                tensors = [g if g is not None else torch.zeros(s.shape, dtype=self.compute_dtype, device=device)
                           for g, s in zip(grads, L.slots)]
                self.pack_slots(tensors, inp, 1.0 / self.reduce_group.backend.world_size)
                out = inp[self.rank * L.shard_numel: (self.rank + 1) * L.shard_numel]
                work = dist.reduce_scatter_tensor(out, inp, op=ReduceOp.SUM, group=self.reduce_group, async_op=True)
                return PendingReduce(self, work, out, inp, out_borrowed=True)
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
                    self.pack_slots(tensors, inp)
            out = torch.empty(L.shard_numel, dtype=self.reduce_dtype, device=device)
            work = dist.reduce_scatter_tensor(out, inp, op=ReduceOp.AVG, group=self.reduce_group, async_op=True)
        return PendingReduce(self, work, out, inp)

    def reduce_across_replicas(self, pending: PendingReduce) -> None:
        """Hybrid sharding: once the reduce-scatter is done, average the shard over the replicas
        (async; the caller waits). The input is spent: freed here."""
        pending.work.wait()
        pending.inp = None
        pending.replicas_left = False
        pending.work = dist.all_reduce(pending.out, op=ReduceOp.AVG, group=self.replicate_group, async_op=True)

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Wait for `pending` and add its result to the parameters' .grad (master dtype)."""
        if pending.replicas_left:
            self.reduce_across_replicas(pending)
        pending.work.wait()
        # The input is spent once the reduce-scatter is done: free it before the cast allocates.
        pending.inp = None
        with torch.no_grad():
            if pending.out.dtype != self.master_dtype:
                g = pending.out.to(self.master_dtype)
            else:                                       # a borrowed slot is reused: the gradient needs its own
                g = pending.out.clone() if pending.out_borrowed else pending.out
            self.add_grad(g)
        pending.inp = pending.out = None

    def add_grad(self, g: torch.Tensor) -> None:
        """Add the flat (shard_numel,) gradient `g` to the parameters' .grad. Where the optimizer
        left them as this unit's views (or None), that is one add on the flat buffer.

        NOTE: the flat gradient and its views are held weakly: the parameters' .grad hold it. A
        strong reference kept all of a rank's fp32 gradient shards (4 bytes x params / ranks)
        alive after optimizer.zero_grad(set_to_none=True), through the next forward and backward
        (issue 26: 2 GiB of a 1.1B Llama's peak at 2 ranks)."""
        grads = [p.grad for p in self.params]
        if all(x is None for x in grads):
            views = self.layout.local_views(self.rank, g)
            for p, view in zip(self.params, views):
                p.grad = view
            self._grad_flat, self._grad_views = weakref.ref(g), [weakref.ref(v) for v in views]
            return
        flat = self._grad_flat() if self._grad_flat is not None else None
        if flat is not None and all(x is ref() for x, ref in zip(grads, self._grad_views)):
            flat.add_(g)
            return
        for p, view in zip(self.params, self.layout.local_views(self.rank, g)):   # the script replaced some .grad
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.add_(view)
        self._grad_flat, self._grad_views = None, []

    @property
    def grads(self) -> List[Optional[torch.Tensor]]:
        return [p.grad for p in self.params]

    def __repr__(self):
        return (f"ShardedUnit({self.index}, {self.layout}, compute={self.compute_dtype}, "
                f"reduce={self.reduce_dtype}, persistent={self.persistent})")
