"""DDP's reduction of gradient buckets: pack -> comm hook -> unpack, plus unused parameters, the
one-time bucket rebuild in gradient-ready order, and the broadcasts of module state from rank 0.
Where the unpack runs (at the end of backward, or on a side stream as each all-reduce ends) is
decided per bucket by _unpacks_early.
Policy only: when a bucket is ready is buckets.py's business, how bytes move is the Backend's
(pack/unpack are one CUDA kernel on nccl, torch ops on gloo). A user's hook gets the bucket as
torch's does (not divided: torch's hooks average themselves); a built-in hook runs fused, its 1/N
folded into the pack (hooks.BUILTIN_HOOKS).
"""
from __future__ import annotations

import weakref
from typing import List

import torch

from . import comm_path as comm_paths
from . import hooks as comm_hooks
from .buckets import DEFAULT_FIRST_BUCKET_BYTES, Bucket, GradBucketer
from .graph_walk import params_reached
from ..comm.groups import resolve_group
from ..comm.reduce_op import ReduceOp

def _deregister(registrations: list) -> None:
    """Drops NCCL registrations of bucket buffers (in place; a destroyed communicator's are gone)."""
    while registrations:
        comm, handle = registrations.pop()
        comm.deregister_buffer(handle)


class Reducer:
    """Owns the bucketer of a DDP module and what happens to a ready bucket."""

    def __init__(self, named_params, group, bucket_cap_bytes: int, find_unused: bool, grad_as_view: bool,
                 static_graph: bool, comm_path: str = "auto"):
        self.group = group
        self.backend = group.backend
        self.scale = 1.0 / group.world_size      # the pack's scale; _setup_buckets sets it per hook
        self.find_unused = find_unused
        self.grad_as_view = grad_as_view
        self.static_graph = static_graph
        # The first bucket is small (1 MiB) so that communication starts early; never above the cap.
        self.bucketer = GradBucketer([p for _, p in named_params], self._on_bucket_ready, self._on_backward_end,
                                     bucket_cap_bytes=bucket_cap_bytes,
                                     first_bucket_cap_bytes=min(DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_bytes),
                                     param_names={p: n for n, p in named_params})
        self.bucketer.register_hooks()
        self.bucketer.on_deferred_end = self._learn_static_unused
        self.params = self.bucketer.params
        self.device = self.params[0].device
        self.hook, self.hook_state = comm_hooks.allreduce_hook, group
        self.hook_registered = False
        self.pending: list = []
        self.rebuilt = False
        # static_graph: which parameters go unused, learnt in the first iteration (local, global).
        self.static_unused = None
        self._locally_unused: set = set()
        # CUDA only (CPU has no streams): the pack runs off the stream backward runs on.
        self.pack_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.unpack_stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.unpack_early = False        # _unpacks_early; off: no gain in the A/B of issue 26 (RESULTS, s9)
        self.tail_chunks = 1             # the fused last bucket's pack/all-reduce/unpack pipelined in slices
        # NOTE: opt-in (ddp_bench's lever "copy-pack"): on the split paths (comm_path.py) the pack copies
        # on the copy engines and each rank scales its reduced shard (reduce_bucket's copy_pack), so no
        # pack kernel holds SMs beside backward. Measured slower than the pack kernel on 2xH100
        # (benchmarks/RESULTS.md, session 16). Every rank must agree (a shard scaled by some ranks
        # only is wrong): set it alike everywhere, before a step.
        self.copy_pack = False
        self.retired_windows: List[torch.Tensor] = []   # embedding_rows.py's, freed outside a capture
        # The communicator that runs a whole bucket in one C++ call (see _fused_comm), or None.
        self.fused_comm = None
        self._allow_fused = True
        self._register_buffers = False
        self._registrations: list = []                    # (communicator, handle) of registered buckets
        self.requested_comm_path = comm_path              # comm_path.py: where the fused buckets' wires live
        self.comm_path = comm_paths.CommPath("default")
        self.overlap = None                               # optimizer_overlap.OptimizerOverlap, if asked for
        self.tied_rows = None                             # embedding_rows.TiedEmbeddingRows, where it applies
        # Parameters marked ready by mark_ready_with in this backward: index -> what their bucket reduces.
        self.diverted: dict = {}
        weakref.finalize(self, _deregister, self._registrations)
        self._setup_buckets()

    @property
    def allow_fused(self) -> bool:
        """Whether buckets may take the one-call C++ path (on by default; off runs the same
        stream, kernel and collective through Python, for comparison)."""
        return self._allow_fused

    @allow_fused.setter
    def allow_fused(self, enabled: bool) -> None:
        self._allow_fused = bool(enabled)
        self.fused_comm = self._fused_comm()
        self._update_registrations()

    @property
    def register_buffers(self) -> bool:
        """Whether each bucket's wire buffer is registered with NCCL (ncclCommRegister, NCCL >=
        2.19) so that its all-reduce may skip NCCL's staging copies. Off by default: an A/B of
        issue 19 (ddp_bench --levers register). Redone eagerly whenever buckets are (re)built,
        so set it before capturing a step; applies to the one-call CUDA path only."""
        return self._register_buffers

    @register_buffers.setter
    def register_buffers(self, enabled: bool) -> None:
        self._register_buffers = bool(enabled)
        self._update_registrations()

    def _update_registrations(self) -> None:
        _deregister(self._registrations)
        comm = self.fused_comm
        if self._register_buffers and comm is not None and hasattr(comm, "register_buffer"):
            self._registrations.extend((comm, comm.register_buffer(b.extra["wire"])) for b in self.bucketer.buckets)

    # ------------------------------------------------------------------ buckets
    def _setup_buckets(self) -> None:
        # NOTE: torch's semantics: a user's hook averages the bucket itself, so only a built-in
        # hook gets the 1/N folded into the pack (over the group it reduces over, as torch's does).
        self.builtin_hook = self.hook in comm_hooks.BUILTIN_HOOKS
        self.scale = 1.0 / comm_hooks.hook_world_size(self.hook_state) if self.builtin_hook else 1.0
        wire_dtype = getattr(self.hook, "wire_dtype", None)
        last = len(self.bucketer.buckets) - 1
        for b in self.bucketer.buckets:
            wire = b.buffer
            if wire_dtype is not None and wire_dtype != b.dtype:
                wire = torch.zeros(b.numel, dtype=wire_dtype, device=b.device)
            b.extra["wire"] = wire
            b.extra["grad_bucket"] = comm_hooks.GradBucket(b.index, wire, b.params, b.index == last)
        self.fused_comm = self._fused_comm()
        if self.fused_comm is not None:
            # NOTE: collective (every rank rebuilds its buckets at the same point of the same step).
            self.comm_path = comm_paths.place_wires(self.bucketer.buckets, resolve_group(self.hook_state),
                                                    self.requested_comm_path)
        else:
            for b in self.bucketer.buckets:
                b.extra["result"] = b.extra["wire"]
            self.comm_path = comm_paths.CommPath("default", reason="no fused CUDA path (gloo, or a user's hook)")
        self._update_registrations()

    def _fused_comm(self):
        """The C++ communicator when a bucket's pack and hook may run as one
        `Communicator.reduce_bucket` call: CUDA, a built-in SUM hook, over an NCCL group.
        Otherwise (gloo, a user's hook) the hook is called from Python."""
        if self.pack_stream is None or not self._allow_fused or not self.builtin_hook:
            return None
        try:
            backend = resolve_group(self.hook_state).backend
        except TypeError:            # not a pynccl group: the hook itself will say so when called
            return None
        comm = getattr(backend, "comm", None)
        return comm if hasattr(comm, "reduce_bucket") else None

    def register_comm_hook(self, state, hook) -> None:
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if self.hook_registered:
            raise RuntimeError("register_comm_hook can only be called once.")
        if self.bucketer.in_backward:
            raise RuntimeError("register_comm_hook: cannot register a hook during a backward pass")
        self.hook, self.hook_state, self.hook_registered = hook, state, True
        self._setup_buckets()

    def _rebuild_buckets(self) -> None:
        """Once, after the first iteration: re-bucket in the order gradients became ready.
        Rank 0's order is broadcast so that every rank builds the same buckets."""
        # A rank that joined (join.py) before its first step has no order: the current one serves.
        order = self.bucketer.ready_order or [i for b in self.bucketer.buckets for i in b.param_indices]
        order = torch.tensor(order, dtype=torch.int64, device=self.device)
        self.backend.broadcast(order, 0)
        self.bucketer.rebuild(order.tolist())
        self._setup_buckets()
        if self.overlap is not None:
            self.overlap.rebuild()
        if self.grad_as_view:
            for b in self.bucketer.buckets:
                for p, v in zip(b.params, b.views()):
                    if p.grad is not None:
                        v.copy_(p.grad)
                        p.grad = v
        self.rebuilt = True

    # ------------------------------------------------------------------ iteration
    def will_rebuild(self) -> bool:
        """Whether the next synced forward rebuilds the buckets (a broadcast from rank 0)."""
        may_rebuild = self.static_graph or not self.find_unused
        return may_rebuild and not self.rebuilt and bool(self.bucketer.ready_order)

    def prepare_for_forward(self) -> None:
        self.bucketer.check_prior_backward_finished()
        if self.retired_windows and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.retired_windows.clear()
        if self.will_rebuild():
            self._rebuild_buckets()

    def prepare_for_backward(self, output) -> None:
        # NOTE: static_graph never walks the graph (a parameter may be used outside forward, or by a
        # later forward before the backward): as torch, the first backward says which parameters get
        # a gradient, and reduces every bucket at its end (_learn_static_unused).
        defer = self.static_graph and self.static_unused is None
        if self.static_unused is not None:
            unused = [self.params[i] for i in sorted(self.static_unused[0])]
        elif self.find_unused and not self.static_graph:
            reached = params_reached(output)
            unused = [p for p in self.params if id(p) not in reached]
        else:
            unused = []
        self._locally_unused = set()
        if unused:
            unused_ids = {id(p) for p in unused}
            self._locally_unused = {i for i, p in enumerate(self.params) if id(p) in unused_ids}
        self.diverted = {}
        self.bucketer.prepare_for_backward(unused, defer=defer)

    def _learn_static_unused(self, ready: List[bool]) -> None:
        """static_graph, the end of the first backward: what went unused here (locally: no gradient in
        this backward) and everywhere (no rank's gradient since the last reduction: one all-reduce of
        the used-map), kept for every later iteration."""
        used = torch.tensor(self.bucketer.used, dtype=torch.int32, device=self.device)
        self.bucketer.reset_used()
        self.backend.all_reduce(used, ReduceOp.SUM)
        self._locally_unused = {i for i, r in enumerate(ready) if not r}
        self.static_unused = (self._locally_unused, {i for i, n in enumerate(used.tolist()) if n == 0})

    def mark_ready_with(self, idx: int, source: torch.Tensor) -> None:
        """Parameter `idx` is ready now, with `source` (not its .grad) as what its bucket reduces;
        its own gradient hook later in this backward is ignored, and .grad is left alone
        (embedding_rows.py: the tied weight's head part, reduced before the rest arrives)."""
        self.diverted[idx] = source
        self.bucketer.mark_ready_early(idx)

    def _reduced_of(self, idx: int):
        """Where diverted parameter `idx`'s reduced gradient lies after the write-back (its bucket
        view, or with copies the diverted tensor itself, unpacked into); None if not diverted."""
        source = self.diverted.pop(idx, None)
        if source is None or not self.grad_as_view:
            return source
        b = self.bucketer.buckets[self.bucketer._bucket_of[idx]]
        return b.views()[b.param_indices.index(idx)]

    # ------------------------------------------------------------------ reduction
    def _sources(self, b: Bucket) -> List[torch.Tensor]:
        """What to pack, on the stream that produced the gradients (NOTE: any tensor made or
        dropped here belongs to that stream, so no other stream frees memory under it).
        gradient_as_bucket_view: a gradient that already is its bucket view is packed as itself
        (_reduce then skips the copy); a fresh one (grads were set to None) becomes the view here
        and the pack moves it in, so one fused launch on the side stream replaces a copy per
        parameter on the compute stream."""
        diverted = self.diverted
        if not self.grad_as_view:
            return [diverted[i] if i in diverted else p.grad if p.grad is not None else torch.zeros_like(p)
                    for i, p in zip(b.param_indices, b.params)]
        sources = []
        for i, p, v in zip(b.param_indices, b.params, b.views()):
            g = p.grad
            if i in diverted:                # .grad is not this bucket's: the diverted tensor is packed in
                sources.append(diverted[i])
            elif g is None:
                v.zero_()
                sources.append(v)
            elif g.data_ptr() != v.data_ptr():
                sources.append(g)            # kept alive by self.pending until the streams join
                p.grad = v
            else:
                sources.append(v)
        return sources

    def _reduce(self, b: Bucket, sources: List[torch.Tensor]):
        wire = b.extra["wire"]
        if b.extra["result"] is not wire:        # a padded symmetric wire: the hook sees the unpadded part
            wire = b.extra["result"]
        if wire is b.buffer and all(s is v for s, v in zip(sources, b.views())):
            # The gradients already are the buffer: no copy; and no kernel at all when the
            # scale is 1 (world size 1), which is the identity.
            if self.scale != 1.0:
                wire.mul_(self.scale)
        else:
            self.backend.pack(sources, wire, self.scale)
        if self.builtin_hook:                    # already scaled by 1/N and cast: only the SUM is left
            return comm_hooks.sum_all_reduce(self.hook_state, wire)
        bucket = b.extra["grad_bucket"]
        bucket.set_buffer(wire)                  # a hook may have swapped it last time (GradBucket.set_buffer)
        return self.hook(self.hook_state, bucket)

    def _unpacks_early(self, b: Bucket) -> bool:
        """Whether the fused call itself unpacks bucket b into its parameters' .grad, on the
        unpack stream as soon as its all-reduce ends (unpack_early), instead of _write_back at
        the end of backward. Only where that write-back would be the plain unpack into the
        same tensors: every grad exists, no parameter of b is unused here (find_unused /
        static_graph: which ones went unused everywhere is known only at the end, but a
        parameter used here is used), no grad views (nothing to unpack), no overlapped
        optimizer (it writes back and steps on its own stream). Gloo and a user's hook never
        reach the fused call."""
        if not self.unpack_early or self.grad_as_view or self.overlap is not None or self.diverted:
            return False
        return self._locally_unused.isdisjoint(b.param_indices) and all(p.grad is not None for p in b.params)

    @torch.no_grad()
    def _on_bucket_ready(self, b: Bucket) -> None:
        """Starts the bucket's reduction; the gradients are written back at the end of backward
        (_on_backward_end), or by the fused call where _unpacks_early says so.
        NOTE: late by default on CUDA (on the compute stream): unpacks overlapping backward cost more
        than the same copies after it on one H200, and gained nothing on 2xH100 nanoGPT (0.90 early
        against 0.88 late, benchmarks/RESULTS.md)."""
        if self.tied_rows is not None:                   # before the tied bucket's collective, on every rank
            self.tied_rows.before_bucket(b)
        sources = self._sources(b)
        early = False
        if self.fused_comm is not None:
            # pack on the side stream, then the all-reduce (then the unpack): one C++ call (bucket_reduce.cpp)
            early = self._unpacks_early(b)
            work = self._fused_reduce(b, sources, self.scale, early)
            handle = comm_hooks._Pending(work, b.extra["result"])
        elif self.pack_stream is not None:
            # The same through Python: pack on the side stream, the hook's collective after it.
            self.pack_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.pack_stream):
                handle = self._reduce(b, sources)
        else:
            handle = self._reduce(b, sources)
        self.pending.append((b, handle, sources, early))  # sources: alive until the streams join
        if self.overlap is not None:
            self.overlap.step_bucket(b, handle)

    def _fused_reduce(self, b: Bucket, sources: List[torch.Tensor], scale: float, early: bool = False):
        """Bucket b's one C++ call (bucket_reduce.cpp): `sources` packed into its wire times `scale`,
        reduced, and with `early` unpacked on the unpack stream. NOTE: the one place that makes it,
        for a training rank's gradients and a joined rank's zeros alike (reduce_zeros), so every rank
        makes the same NCCL calls for b: its own wire (a symmetric window: the same kernel), split or
        not, the last bucket in slices, the all-to-all's scratch, the copy-engine pack."""
        last = b.index == len(self.bucketer.buckets) - 1
        return self.fused_comm.reduce_bucket(sources, b.extra["wire"], scale, self.pack_stream.cuda_stream,
                                             self.comm_path.split_all_reduce,
                                             self.unpack_stream.cuda_stream if early else 0,
                                             self.tail_chunks if last else 1, b.extra.get("scratch"),
                                             self._copy_pack(b))

    def _copy_pack(self, b: Bucket) -> bool:
        """Whether bucket b's fused call packs on the copy engines and scales the reduced shard
        instead (decided from what every rank shares: the setting, the path, the wire's dtype)."""
        return self.copy_pack and self.comm_path.split_all_reduce and b.extra["wire"].dtype == b.dtype

    def set_divisor(self, divisor=None) -> None:
        """A built-in hook divides by `divisor` instead of its group's size (join() with
        divide_by_initial_world_size=False; a user's hook divides as it likes); None restores it."""
        if self.builtin_hook:
            self.scale = 1.0 / (divisor or comm_hooks.hook_world_size(self.hook_state))

    @torch.no_grad()
    def reduce_zeros(self, divisor=None) -> None:
        """A joined rank's part in one backward of the ranks still training (join.py): each
        bucket's reduction, of zeros, through the same hook and in the same order, then the
        used-map all-reduce where they run one (_globally_unused). `divisor`: what the ranks still
        training divide by (set_divisor's; None: the group's size), for a shard that every rank
        scales (copy_pack)."""
        handles, packed, last = [], [], len(self.bucketer.buckets) - 1
        scale = 1.0 / divisor if divisor and self.builtin_hook else self.scale
        for b in self.bucketer.buckets:
            zeros = torch.zeros_like(b.extra["result"])
            if self.fused_comm is not None:
                # NOTE: the very call the training ranks make (_fused_reduce), with zeros packed in:
                # a joined rank reducing a plain buffer ran another NCCL algorithm than its peers
                # and hung (2xH100, s9). The training ranks' scale, not 1: zeros scale to zeros in a
                # pack, but with copy_pack every rank scales its reduced shard, this one's too.
                work = self._fused_reduce(b, [zeros], scale)
                handles.append(comm_hooks._Pending(work, b.extra["result"]))
                packed.append(zeros)         # read on the pack stream: alive until the waits below
            elif self.builtin_hook:
                handles.append(comm_hooks.sum_all_reduce(self.hook_state, zeros))
            else:
                bucket = comm_hooks.GradBucket(b.index, zeros, b.params, b.index == last)
                handles.append(self.hook(self.hook_state, bucket))
        if self.static_unused is None and (self.find_unused or self.static_graph):
            self.backend.all_reduce(torch.zeros(len(self.params), dtype=torch.int32, device=self.device), ReduceOp.SUM)
        for h in handles:
            h.wait()

    def _globally_unused(self) -> set:
        """Indices of parameters no rank used since the last reduction (their grads stay as they
        are, as in torch). One small all-reduce of a used-map; host sync only where needed."""
        if self.static_unused is not None:
            return self.static_unused[1]
        if not (self.find_unused or self.static_graph):
            return set()
        used = torch.tensor(self.bucketer.used, dtype=torch.int32, device=self.device)
        self.bucketer.reset_used()
        self.backend.all_reduce(used, ReduceOp.SUM)
        if not self._locally_unused and not self.static_graph:
            return set()
        unused = {i for i, n in enumerate(used.tolist()) if n == 0}
        if self.static_graph:
            self.static_unused = (self._locally_unused, unused)
        return unused

    @torch.no_grad()
    def _on_backward_end(self) -> None:
        self._write_back_all()
        if self.tied_rows is not None:                   # after the write-back: adds into the reduced grads
            self.tied_rows.finish(self.scale, self._reduced_of)
        self.diverted = {}

    def _write_back_all(self) -> None:
        if self.pack_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.pack_stream)
        pending, self.pending = self.pending, []
        if self.overlap is not None:                     # those buckets are written back and stepped
            pending = [x for x in pending if x[0].index not in self.overlap.stepped]
            self.overlap.finish_backward()
        if not pending:
            return
        unused = self._globally_unused()
        for b, handle, _, early in pending:
            if early:
                handle.wait()                            # the grads are written: a stream join
                continue
            self._ensure_grads(b, unused)
            self._write_back(b, handle.wait(), unused)

    def _ensure_grads(self, b: Bucket, unused: set) -> None:
        """A parameter unused here but used elsewhere gets a gradient to receive the result."""
        for i, p, v in zip(b.param_indices, b.params, b.views()):
            if p.grad is None and i not in unused and i not in self.diverted:
                p.grad = v if self.grad_as_view else torch.zeros_like(p)

    def _write_back(self, b: Bucket, reduced, unused: set) -> None:
        if not isinstance(reduced, torch.Tensor) or reduced.numel() != b.numel:
            got = reduced.numel() if isinstance(reduced, torch.Tensor) else type(reduced).__name__
            raise RuntimeError(f"comm hook: wait() must return the reduced bucket ({b.numel} elements), "
                               f"got {got} for bucket {b.index}")
        if unused and any(i in unused for i in b.param_indices):
            self._write_back_skipping(b, reduced, unused)
        elif self.grad_as_view:
            if reduced is not b.buffer:
                self.backend.unpack(reduced, b.views(), 1.0)
        else:
            self.backend.unpack(reduced, [self.diverted.get(i, p.grad) for i, p in zip(b.param_indices, b.params)],
                                1.0)

    def _write_back_skipping(self, b: Bucket, reduced: torch.Tensor, unused: set) -> None:
        """Rare path (some parameter of the bucket went unused on every rank): per tensor."""
        for i, p, offset, v in zip(b.param_indices, b.params, b.offsets, b.views()):
            if i in unused:
                continue
            src = reduced[offset: offset + p.numel()].view(p.shape)
            if self.grad_as_view:
                if reduced is not b.buffer:
                    v.copy_(src)
            else:
                self.diverted.get(i, p.grad).copy_(src)
