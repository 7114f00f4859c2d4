"""ZeRO stages 1 and 2: every rank keeps the full parameters (compute dtype) for forward and
backward; the optimizer sees only flat master shards, so its state is sharded.

One sharded unit per GradBucketer bucket (the buckets and gradient-ready hooks DDP uses), so
a bucket's gradients reduce-scatter straight into that unit's shard. Stage 2 starts each
bucket's reduce-scatter as soon as backward hands it out and frees the bucket's full
gradients, overlapping communication with the rest of backward; stage 1 reduces every
bucket after backward. At most MAX_IN_FLIGHT reduce buffers exist at a time.

Updated shards are all-gathered lazily, at the start of the next forward, once something may
have changed them: a backward that reduced gradients (a step follows), a torch.optim step of
any optimizer that holds these parameters (a global step post-hook), a checkpoint load, or a
write into a parameter outside a step (p.copy_ of EMA weights and back, p.data = ...: its
version counter or storage changed). Version counters alone would not do: fused optimizers
(AdamW(fused=True), the CUDA default in nanoGPT and HF) update parameters without bumping
them, and a missed gather silently freezes the model. Evaluation forwards and no_sync
accumulation between two steps still cost no gather.
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import List

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..comm.symmetric import alloc_symmetric
from ..ddp.buckets import DEFAULT_FIRST_BUCKET_BYTES, GradBucketer
from .flat_unit import ReduceQueue, ShardedUnit, SymmetricReduceRing
from .layout import FlatLayout
from .params import ParamInfo, install

MAX_IN_FLIGHT = 2


class ReplicatedParamsRuntime:
    """Owns the units, the full-parameter leaves the module computes with, and the bucketer."""

    def __init__(self, stage: int, infos: List[ParamInfo], tensors: List[torch.Tensor], group, policy,
                 bucket_cap_bytes: int, sync_module_states: bool, replicate_group=None):
        self.stage = stage
        trainable = [(info, t) for info, t in zip(infos, tensors) if info.requires_grad]
        # Leaves the module computes with; their memory is pointed into a unit's flat buffer below
        # (storage resized to 0 until then, so bucketing allocates nothing extra for them).
        leaves = []
        for info, t in trainable:
            leaf = torch.empty(t.shape, dtype=policy.param_dtype or t.dtype, device=t.device, requires_grad=True)
            leaf.untyped_storage().resize_(0)
            leaves.append(leaf)
        self.bucketer = GradBucketer(
            leaves, self._on_bucket_ready, self._on_backward_end, bucket_cap_bytes=bucket_cap_bytes,
            first_bucket_cap_bytes=min(DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_bytes),
            param_names={leaf: info.name for leaf, (info, _) in zip(leaves, trainable)}, pad_to=group.world_size)
        self.units: List[ShardedUnit] = []
        self.unit_leaves: List[List[torch.Tensor]] = []
        layouts, members_of = [], []
        for bucket in self.bucketer.buckets:
            # NOTE: units own their buffers; the bucket's own flat buffer is never used here.
            bucket.buffer = bucket.buffer.new_empty(0)
            members = [trainable[i] for i in bucket.param_indices]
            members_of.append(members)
            layouts.append(FlatLayout([info.name for info, _ in members], [t.shape for _, t in members],
                                      [info.index for info, _ in members], group.world_size))
        fulls, ring = self._symmetric_buffers(layouts, members_of, group, policy)
        self.symmetric = fulls is not None
        for bucket, members, layout, full in zip(self.bucketer.buckets, members_of, layouts, fulls or [None] * len(layouts)):
            unit = ShardedUnit(len(self.units), layout, [t for _, t in members], group, policy.param_dtype,
                               policy.reduce_dtype, persistent=True, sync_from_first_rank=sync_module_states,
                               replicate_group=replicate_group, full_buffer=full, reduce_ring=ring)
            unit_leaves = [leaves[i] for i in bucket.param_indices]
            with torch.no_grad():
                for slot_idx, (leaf, view, (info, _)) in enumerate(zip(unit_leaves, layout.views(unit.full), members)):
                    leaf.data = view
                    install(info, leaf)
                    info.location = (unit.index, slot_idx)
            self.units.append(unit)
            self.unit_leaves.append(unit_leaves)
        self.bucketer.register_hooks()
        self.in_flight = ReduceQueue(MAX_IN_FLIGHT)
        self._param_ids = {id(p) for u in self.units for p in u.params}
        self._seen = [self._signature(u) for u in self.units]   # see _note_writes
        handle = register_optimizer_step_post_hook(functools.partial(_after_optimizer_step, weakref.ref(self)))
        weakref.finalize(self, handle.remove)

    @staticmethod
    def _symmetric_buffers(layouts, members_of, group, policy):
        """Collective: every unit's full buffer and a ring of reduce-scatter buffers in one NCCL
        symmetric window (comm/symmetric.py), so the re-gathers run on the copy engines and the
        reduce-scatters on NCCL's symmetric kernels; (None, None) where that is off
        (PYNCCL_ZERO_SYMMETRIC=0, gloo, one rank, a requirement missing: symmetric_support says)."""
        if os.environ.get("PYNCCL_ZERO_SYMMETRIC", "1").strip() == "0" or not layouts:
            return None, None
        compute = [policy.param_dtype or members[0][1].dtype for members in members_of]
        reduce_dtypes = {policy.reduce_dtype or c for c in compute}
        if len(reduce_dtypes) != 1:                   # one ring, one dtype
            return None, None
        ring_numel = max(layout.padded_numel for layout in layouts)
        sizes = [(layout.padded_numel, c) for layout, c in zip(layouts, compute)]
        sizes += [(ring_numel, reduce_dtypes.pop())] * (MAX_IN_FLIGHT + 1)
        buffers = alloc_symmetric(group, sizes)
        if buffers is None:
            return None, None
        return buffers[:len(layouts)], SymmetricReduceRing(buffers[len(layouts):])

    def mark_stale(self) -> None:
        """Every unit re-gathers before the next forward (its shard may have changed)."""
        for u in self.units:
            u.stale = True

    def holds_params_of(self, optimizer) -> bool:
        return any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"])

    # ------------------------------------------------------------------ forward
    @staticmethod
    def _signature(unit: ShardedUnit) -> list:
        return [(p._version, p.data_ptr()) for p in unit.params]

    def _note_writes(self) -> None:
        """A unit whose parameters were written since its last gather (p.copy_, p.mul_, p.data = ...:
        the nn.Parameter's own version counter or storage changed) is stale: this rank's rows of its
        full buffer, or all of them (mixed precision), no longer match every rank's shard."""
        for u, seen in zip(self.units, self._seen):
            if not u.stale and self._signature(u) != seen:
                u.stale = True

    @torch._disable_dynamo                             # never traced by torch.compile (collectives)
    def pre_forward(self, sync_grads: bool) -> None:
        self._note_writes()
        stale = [u for u in self.units if not u.is_current]
        for u in stale:                                # start every gather, then wait: they overlap
            u.gather()
        for u in stale:
            u.wait_gather()
            self._seen[u.index] = self._signature(u)   # after gather's check_params: views again
        # NOTE: a forward without grad (evaluation) leaves the hooks as they are: the backward
        # of an earlier forward may still be to come, as in torch DDP.
        if torch.is_grad_enabled():
            self._check_prior_backward()
            if sync_grads:
                self.bucketer.prepare_for_backward()
            else:
                self.bucketer.disarm()

    def _check_prior_backward(self) -> None:
        if self.bucketer.in_backward:
            missing = self.bucketer.unready_param_names()
            try:
                self.bucketer.check_prior_backward_finished()   # resets the bucketer
            except RuntimeError:
                pass                                    # its DDP-worded message; ours follows
            raise RuntimeError(
                f"FullyShardedDataParallel(stage={self.stage}): the previous backward produced no gradient for "
                f"{', '.join(missing)}. In stages 1 and 2 every trainable parameter must take part in the loss: "
                f"freeze unused ones with requires_grad_(False) before wrapping, or use stage=3.")

    # ------------------------------------------------------------------ backward
    def _on_bucket_ready(self, bucket) -> None:
        if self.stage == 2:
            self._launch(bucket.index)

    def _on_backward_end(self) -> None:
        if self.stage == 1:
            for i in range(len(self.units)):
                self._launch(i)
        self.drain()
        self.mark_stale()                              # gradients reduced: a step is coming
        # NOTE: armed again for a further backward through the same graph (loss1.backward(retain_graph=True);
        # loss2.backward()): it reduces too, adding to the shards' gradients, as torch accumulates .grad.
        # Disarmed, its gradients would stay on the full leaves and leak into the next step's reduce.
        self.bucketer.prepare_for_backward()

    def _launch(self, unit_idx: int) -> None:
        leaves = self.unit_leaves[unit_idx]
        self.in_flight.append(self.units[unit_idx].reduce_grad([leaf.grad for leaf in leaves]))
        for leaf in leaves:
            leaf.grad = None                            # only the shard and in-flight buckets stay
        self.in_flight.trim()

    def drain(self) -> None:
        self.in_flight.drain()

    # ------------------------------------------------------------------ introspection
    def held_tensors(self) -> dict:
        """Tensors this runtime holds, by role (for memory accounting)."""
        return {"params_full": [u.full for u in self.units], "params_shard": [u.shard for u in self.units],
                "grads_unreduced": [leaf.grad for ls in self.unit_leaves for leaf in ls],
                "grads_in_flight": self.in_flight.buffers(),
                "grads_shard": [g for u in self.units for g in u.grads]}


def _after_optimizer_step(runtime_ref, optimizer, args, kwargs) -> None:
    runtime = runtime_ref()
    if runtime is not None and runtime.holds_params_of(optimizer):
        runtime.mark_stale()
