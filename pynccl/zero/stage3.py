"""ZeRO stage 3: parameters are sharded too; only the master shards persist between steps.

Each unit (a transformer block, or modules the user names; parameters outside every unit form
the root unit) is all-gathered right before its forward, with the next unit's gather already
in flight, and its memory is released (storage resized to 0) right after. For backward:
  * a gradient hook on the unit's outputs fires just before the unit's backward starts; it
    makes sure the unit is gathered and starts gathering the unit backward reaches next;
  * saved-tensor hooks record tensors that autograd saves from a unit's buffer as
    (unit, offset, size, stride) instead of a reference, and rebuild them from the re-gathered
    buffer when backward unpacks them (gathering on the spot if no hook did), so freeing a
    unit after forward can never leave backward reading freed memory;
  * the unit's parameters are views of one leaf (ShardedUnit.full), so autograd sums their
    gradients into full.grad; its post-accumulate hook reduce-scatters that flat gradient
    into the shard and frees both the gradient and the parameters.
The root unit stays gathered from the start of forward until its gradient is ready.
Where the group has NCCL symmetric memory, the other units gather into a ring of slots in one
window registered at wrap time (gather_ring.py), so their all-gathers run on the copy engines.

Gradients are reduce-scattered in one fixed order on every rank (descending unit index, the
root last), not in the order hooks fire: a unit whose hook fires early waits for the units
before it in that order, and at the end of backward every unit still waiting is reduced,
with a zero gradient where its hook never fired (a conditional branch skipped it, here or
on all ranks). All-gathers follow their own fixed order (block index). The two sequences
interleave differently on a rank that skipped a block, so the reduce-scatters run on a second
communicator over the same ranks: each sequence matches on every rank, and a model that runs
its blocks in order keeps full overlap.

Activation checkpointing: a unit's forward that runs inside backward (recomputation) gathers
only that unit, prefetches nothing forward, and keeps it for the backward that follows, so
no more than two units (and the root) are gathered at a time during backward.
"""
from __future__ import annotations

import functools
import weakref
from typing import Dict, List, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from ..comm.groups import duplicate_group
from .backward_pacing import BackwardPacer, connect_reduce_paths, lead_from_env
from .flat_unit import ReduceQueue, ShardedUnit
from .gather_ring import build_gather_ring
from .gather_walk import GatherWalk
from .layout import FlatLayout
from .params import ParamInfo, install
from .placeholder import ShardedParamPlaceholder, make_placeholders


class ShardedParamsRuntime(GatherWalk):
    """Owns the stage-3 units, their module hooks and the saved-tensor hooks; the gather walks are
    GatherWalk's (gather_walk.py)."""

    def __init__(self, unit_modules: List[nn.Module], infos: List[ParamInfo],
                 tensors: List[torch.Tensor], group, policy, sync_module_states: bool, replicate_group=None):
        _never_compiled(ShardedParamsRuntime.pack, ShardedParamsRuntime.unpack)
        unit_of_module: Dict[int, int] = {}
        for u_idx, m in enumerate(unit_modules, start=1):
            for sub in m.modules():
                # A module shared by two units belongs to neither: its parameters go to the root.
                unit_of_module[id(sub)] = u_idx if unit_of_module.get(id(sub), u_idx) == u_idx else 0
        members: Dict[int, list] = {u: [] for u in range(len(unit_modules) + 1)}
        for info, t in zip(infos, tensors):
            if info.requires_grad:
                owner_units = {unit_of_module.get(id(mod), 0) for mod, _ in info.owners}
                members[owner_units.pop() if len(owner_units) == 1 else 0].append((info, t))

        # NOTE: all-gathers follow one fixed order, and reduce-scatters another (see below), but how
        # the two interleave depends on which hooks fire on each rank (a block one rank skips
        # reduces only at the end there). On one communicator that mismatch would hang, so the
        # reduce-scatters run on a second communicator over the same ranks, outside
        # PYNCCL_CHECK_COLLECTIVES's host-blocking check for the same reason (duplicate_group).
        self.reduce_group = duplicate_group(group, "zero3-reduce", checked=False) if group.world_size > 1 else group
        self.units: List[ShardedUnit] = []
        self.unit_infos: List[List[ParamInfo]] = []
        self.root: Optional[ShardedUnit] = None
        self._placeholders: List[List[ShardedParamPlaceholder]] = []    # per unit, one per parameter
        for u_idx, group_members in members.items():
            if not group_members:
                continue
            layout = FlatLayout([i.name for i, _ in group_members], [t.shape for _, t in group_members],
                                [i.index for i, _ in group_members], group.world_size)
            unit = ShardedUnit(len(self.units), layout, [t for _, t in group_members], group, policy.param_dtype,
                               policy.reduce_dtype, persistent=False, sync_from_first_rank=sync_module_states,
                               reduce_group=self.reduce_group, replicate_group=replicate_group)
            for slot_idx, (info, _) in enumerate(group_members):
                info.location = (unit.index, slot_idx)
            self.units.append(unit)
            self.unit_infos.append([i for i, _ in group_members])
            self._placeholders.append(make_placeholders(unit_modules[u_idx - 1] if u_idx else None, self.unit_infos[-1],
                                                        unit.full.device))
            # NOTE: a tensor hook is held from C++, where the garbage collector cannot see it: a
            # strong reference to the runtime (or the unit, which holds the tensor) would keep the
            # whole runtime, every shard included, alive after the model is dropped.
            unit.full.register_post_accumulate_grad_hook(functools.partial(_post_backward_via, weakref.ref(self),
                                                                            unit.index))
            if u_idx == 0:
                self.root = unit
            else:
                m = unit_modules[u_idx - 1]
                m.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
                m.register_forward_hook(functools.partial(self._post_forward, unit))
            self._install_placeholders(unit)

        self._by_storage: Dict[int, ShardedUnit] = {}    # data_ptr of a gathered buffer -> its unit
        self._blocks = [u for u in self.units if u is not self.root]   # the gather order (see below)
        # The root stays gathered for the whole step: it keeps an ordinary buffer.
        self.gather_ring, self.gather_ring_reason = build_gather_ring(self._blocks, group)
        for u in self._blocks:
            u.gather_ring = self.gather_ring
        self._pos = {u.index: i for i, u in enumerate(self._blocks)}
        self._fwd = 0                                    # next block forward gathers
        self._bwd = len(self._blocks) - 1                # next block backward gathers
        self._end_queued = False
        # Blocks this forward / backward used, and how far _leave_passed has checked (see there).
        self._fwd_touched, self._bwd_touched = set(), set()
        self._fwd_passed, self._bwd_passed = 0, len(self._blocks) - 1
        self.sync_grads = True
        self._root_grad = False                          # the grad mode of the root forward running now
        self.in_flight = ReduceQueue(0)               # see _reduce_in_order: drained at the end of backward
        self._ready: Dict[int, torch.Tensor] = {}        # unit index -> full gradient waiting for its turn
        self._cursor = len(self.units) - 1               # next unit index to reduce (descending)
        # Post-accumulate hooks a unit may fire in one backward (see _hooks_due): its forwards since the
        # last backward with grad (one hook at most, in the outer graph task) and without (each may be a
        # reentrant checkpoint, whose recomputation runs its own graph task and fires the hook again).
        self._grad_uses: set = set()
        self._no_grad_uses: Dict[int, int] = {}
        self._fired: Dict[int, int] = {}                 # hooks fired this backward, per unit
        self._pacer = BackwardPacer(self.units[0].full.device if self.units else torch.device("cpu"),
                                    lead_from_env(), group.timeout_s)  # backward_pacing.py: bounds reduce inputs alive
        connect_reduce_paths(self.units)                 # on every rank alike, whatever its lead (see there)

    def describe_gather_ring(self) -> str:
        ring = self.gather_ring
        if ring is None:
            return f"ordinary buffers; gather ring {self.gather_ring_reason}"
        return (f"ring of {len(ring)} slots of {ring.slot_bytes / 2 ** 20:.1f} MiB in a symmetric window "
                f"(block gathers so far: {ring.gathers}, {ring.spilled} in ordinary buffers)")

    def mark_stale(self) -> None:
        """Every unit re-gathers before it is used next (its shard may have changed)."""
        for u in self.units:
            u.stale = True

    # ------------------------------------------------------------------ gather / free
    def _install_placeholders(self, unit: ShardedUnit) -> None:
        # Outside its forward a module sees a tensor without data (placeholder.py), never a view of freed memory.
        for info, placeholder in zip(self.unit_infos[unit.index], self._placeholders[unit.index]):
            install(info, placeholder)

    def _start_gather(self, unit: ShardedUnit) -> None:
        if unit.gather_work is None and not unit.is_current:
            unit.gather()
            if unit.ring_slot is None:                 # a ring slot is found through the ring (pack)
                self._by_storage[unit.full.untyped_storage().data_ptr()] = unit

    def _ensure(self, unit: ShardedUnit) -> None:
        self._start_gather(unit)
        unit.wait_gather()

    def _free(self, unit: ShardedUnit) -> None:
        if unit.is_allocated and unit.ring_slot is None:
            self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
        unit.free()
        self._install_placeholders(unit)

    def _use_full(self, unit: ShardedUnit) -> None:
        # Fresh views every forward: split's backward concatenates the parameter gradients
        # into one flat gradient (zeros for the padding and for unused parameters).
        views = unit.full.split(unit.layout.split_sizes)[1::2]       # odd positions: the parameters
        for info, v in zip(self.unit_infos[unit.index], views):
            install(info, v.view(info.shape))

    # ------------------------------------------------------------------ forward
    # NOTE: torch.compile must not trace the forward bookkeeping (collectives, parameter swaps:
    # traced, they crashed dynamo's shape guards), neither under torch.compile(model) nor when a
    # unit is compiled (module.compile() compiles __call__, hooks included): it runs eagerly.
    @torch._disable_dynamo
    def pre_root_forward(self, sync_grads: bool) -> None:
        self._root_grad = torch.is_grad_enabled()
        if self._root_grad:                            # an evaluation forward leaves a pending backward alone
            self.sync_grads = sync_grads
            self._end_queued = False                   # a backward that raised never ran its callback
        if self.root is not None:
            self._ensure(self.root)
            self._use_full(self.root)
        self._fwd = 0
        self._fwd_touched.clear()
        self._fwd_passed = 0
        self._forward_gather_to(0, free_passed=False)  # the first block is gathering while the root runs

    @torch._disable_dynamo
    def _pre_forward(self, unit: ShardedUnit, module, args) -> None:
        pos = self._pos[unit.index]
        # NOTE: blocks passed over leave the ring before the gathers below take slots (see
        # _backward_gather_to).
        if _in_backward():                             # recomputation (activation checkpointing)
            self._queue_end()
            self._backward_reach(pos, unit)
        else:
            if self._root_grad:
                if torch.is_grad_enabled():
                    self._grad_uses.add(unit.index)
                else:
                    self._no_grad_uses[unit.index] = self._no_grad_uses.get(unit.index, 0) + 1
            self._leave_passed(unit, pos, backward=False)
            self._forward_gather_to(pos, free_passed=True)
        self._ensure(unit)                             # a unit run again (or out of order) gathers again
        self._use_full(unit)
        if not _in_backward():
            self._forward_gather_to(pos + 1, free_passed=False)      # prefetch

    @torch._disable_dynamo
    def _post_forward(self, unit: ShardedUnit, module, args, output) -> None:
        if torch.is_grad_enabled():
            self._hook_outputs(output, functools.partial(self._pre_backward, unit))
        # The last block is the first of backward, and a recomputed unit's backward comes right
        # after its recomputation: keep those. NOTE: "will backward come" is the root forward's grad
        # mode, not this block's: reentrant checkpointing runs the block under no_grad, and a rank
        # that skipped it keeps it in post_root_forward; had the two decided differently, only one
        # would gather it in backward (an all-gather the other never makes: a hang).
        keep = _in_backward() or (self._root_grad and unit is self._blocks[-1])
        if not keep:
            self._free(unit)

    @staticmethod
    def _hook_outputs(output, hook) -> bool:
        outs = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            register_multi_grad_hook(outs, hook, mode="any")
        return bool(outs)

    @torch._disable_dynamo
    def post_root_forward(self, output=None) -> None:
        # NOTE: backward reaches the model's outputs first, in the outermost autograd task: queue
        # the end-of-backward callback there. Queued from a unit hook instead, it could land in
        # a nested task (reentrant checkpointing runs one per unit) and fire too early.
        grad = self._root_grad                         # the same decision as _post_forward's
        if grad:
            self._hook_outputs(output, lambda *unused: self._queue_end())
        # Blocks this rank skipped after the last one it ran: out of the ring before the gathers take
        # slots, each freed once its gather starts but the last (see _backward_gather_to).
        self._release_passed(len(self._blocks), backward=False)
        self._forward_gather_to(len(self._blocks) - 1, free_passed=True)
        last = self._blocks[-1] if self._blocks else None
        for u in self.units:
            if (u is self.root or u is last) and grad:
                continue
            if u.is_allocated or u.gather_work is not None:
                self._free(u)

    # ------------------------------------------------------------------ backward
    def _queue_end(self) -> None:
        if not self._end_queued:
            self._end_queued = True
            self._ready.clear()
            self._fired.clear()
            self._cursor = len(self.units) - 1
            self._bwd = len(self._blocks) - 1
            self._bwd_touched.clear()
            self._bwd_passed = len(self._blocks) - 1
            self._pacer.reset()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _pre_backward(self, unit: ShardedUnit, *unused) -> None:
        self._queue_end()
        pos = self._pos[unit.index]
        self._backward_reach(pos, unit)
        self._ensure(unit)
        # A checkpoint around the module's forward (not its __call__, as HF's layers do) recomputes
        # it without running our forward hooks: the parameters must already be in place, as
        # views that autograd connects to unit.full (hooks run with grad mode off).
        with torch.enable_grad():
            self._use_full(unit)
        self._backward_gather_to(pos - 1)              # prefetch
        if self.sync_grads and self._pacer.block(unit.index):    # after the prefetch: see backward_pacing.py
            self.in_flight.trim_completed()

    def _post_backward(self, unit: ShardedUnit, full: torch.Tensor) -> None:
        self._queue_end()
        if self.sync_grads:
            grad, unit.full.grad = unit.full.grad, None
            if unit.index > self._cursor:
                names = ", ".join(s.name for s in unit.layout.slots[:3])
                raise RuntimeError(
                    f"FullyShardedDataParallel(stage=3): unit {unit.index} ({names}, ...) got a gradient again after "
                    f"its gradient was reduced in this backward: its module ran more than once, at least once "
                    f"inside a reentrant activation checkpoint that ZeRO-3 could not count (one called inside a "
                    f"module's own forward). Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
                    f"checkpoint the module's __call__ (it then gets every use's gradient).")
            held = self._ready.get(unit.index)           # reentrant checkpointing: one hook per use
            self._ready[unit.index] = grad if held is None else held.add_(grad)
            self._fired[unit.index] = self._fired.get(unit.index, 0) + 1
            self._reduce_in_order(final=False)
        self._free(unit)

    def _hooks_due(self, unit: ShardedUnit) -> int:
        """How many post-accumulate hooks `unit` may fire in this backward: at most one for its uses
        with grad (the root's included), one per use without. An overestimate only delays its reduce
        to the end of backward; the order of reduces stays the same."""
        if unit is self.root:
            return 1
        return int(unit.index in self._grad_uses) + self._no_grad_uses.get(unit.index, 0)

    def _reduce_in_order(self, final: bool) -> None:
        """Start the reduce-scatters that are next in the fixed order; with final=True, all that
        remain (a unit whose hook never fired reduces what it accumulated, or zeros)."""
        while self._cursor >= 0:
            unit = self.units[self._cursor]
            if not final and (unit.index not in self._ready or self._fired[unit.index] < self._hooks_due(unit)):
                return
            grad = self._ready.pop(unit.index, None)
            if grad is None:
                grad, unit.full.grad = unit.full.grad, None
                if grad is None:
                    grad = torch.zeros(unit.layout.padded_numel, dtype=unit.reduce_dtype, device=unit.full.device)
            self.in_flight.append(unit.reduce_grad([grad]))
            del grad                                   # the reduce's input holds it now
            # NOTE: never a wait here: a rank that skipped a block starts its reduce only at the
            # end of backward; making this rank's compute stream wait for it would also hold back
            # this rank's later all-gathers (they wait for the compute stream), which the other
            # rank needs to finish its backward: a deadlock on NCCL. Finished reduces free their
            # buffers here; the rest wait for drain() at the end of backward.
            self.in_flight.trim_completed()
            self._cursor -= 1

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self._grad_uses.clear()
        self._no_grad_uses.clear()
        self._backward_reach(-1)                       # blocks skipped below the last one this backward ran
        if self.sync_grads:
            self._reduce_in_order(final=True)
        self.drain()
        for u in self.units:
            if u.is_allocated or u.gather_work is not None:
                self._free(u)

    def drain(self) -> None:
        self.in_flight.drain()

    # ------------------------------------------------------------------ saved tensors
    # NOTE: the offset is kept relative to the unit's buffer: a unit re-gathered for backward
    # may land in another ring slot, or in its own storage.
    def pack(self, t: torch.Tensor):
        if (self._by_storage or self.gather_ring is not None) and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            unit = self._by_storage.get(ptr)
            if unit is None and self.gather_ring is not None:
                unit = self.gather_ring.owner_at(t, ptr)
            if unit is not None and t.dtype == unit.full.dtype:
                return (unit, t.storage_offset() - unit.full.storage_offset(), t.size(), t.stride())
        return t

    def unpack(self, packed):
        if type(packed) is tuple:
            unit, offset, size, stride = packed
            self._ensure(unit)
            full = unit.full.detach()
            return full.as_strided(size, stride, full.storage_offset() + offset)
        return packed

    # ------------------------------------------------------------------ introspection
    def held_tensors(self) -> dict:
        """Tensors this runtime holds, by role (for memory accounting)."""
        ring = list(self.gather_ring.slots) if self.gather_ring is not None else []
        return {"params_full": [u.full for u in self.units] + ring, "params_shard": [u.shard for u in self.units],
                "grads_unreduced": [u.full.grad for u in self.units] + list(self._ready.values()),
                "grads_in_flight": self.in_flight.buffers(),
                "grads_shard": [g for u in self.units for g in u.grads]}


def _never_compiled(*functions) -> None:
    """Keep torch.compile from compiling these functions' frames, at no cost per call.

    NOTE: autograd calls the saved-tensor hooks for every tensor saved in forward; under
    torch.compile(model) that includes the eager stretches between compiled graphs, where dynamo
    compiles every frame it sees: it compiled pack() anew for each kind of saved tensor (dtype,
    rank, requires_grad) until its recompile limit (8) and broke the graph at UntypedStorage.data_ptr,
    seconds of compiling and 8 breaks for a 4-layer GPT-2. torch._disable_dynamo would cost ~10 us
    on each of hundreds of calls a step, compiled or not; marking the code objects costs nothing."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:                               # a torch without dynamo's frame strategies
        return
    for fn in functions:
        skip_code(fn.__code__)


def _post_backward_via(runtime_ref, index: int, full: torch.Tensor) -> None:
    runtime = runtime_ref()
    if runtime is not None:
        runtime._post_backward(runtime.units[index], full)


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (a forward now is a recomputation)."""
    return torch._C._current_graph_task_id() != -1
