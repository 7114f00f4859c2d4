"""Gradient buckets: which parameters share a flat buffer, and the hook machinery that says
when a bucket's gradients are all ready, so its reduction can start while backward goes on.

Written once for every data-parallel wrapper: DDP reduces a ready bucket with all-reduce,
ZeRO-2 with reduce-scatter. The reduction is the caller's; this file only decides *when*.

API
---
Which parameters share a bucket is pynccl.comm.coalesced.assign_buckets (shared with the
coalesced broadcast); this file adds the buffers and the ready hooks.

``GradBucketer(params, on_bucket_ready, on_backward_end=None, *, bucket_cap_bytes=25 MiB,
first_bucket_cap_bytes=1 MiB, param_names=None, pad_to=1)``
    params: in registration order; requires_grad=False ones are dropped, shared ones kept once.
    Buckets are first filled in reverse registration order (the order backward usually
    produces gradients). Each `Bucket` has .index, .params, .offsets (element offsets in the
    flat buffer), .numel (padded up to a multiple of `pad_to`, e.g. world size for
    reduce-scatter), .dtype, .device, .buffer (flat, allocated once per (re)build; padding is
    zero), .views() (the buffer cut into param-shaped views) and .extra (a dict for the
    caller's per-bucket state, e.g. a compressed wire buffer).

    Per iteration:
      * ``prepare_for_backward(unused=())`` arms the hooks for the next backward (call it in
        forward). `unused`: parameters known not to get a gradient this iteration; they count
        as ready at the first hook of the backward. Raises RuntimeError naming the parameters
        that never got a gradient if the previous armed backward did not finish.
      * ``disarm()``: the next backward reduces nothing (no_sync, eval).
      * backward: ``Tensor.register_post_accumulate_grad_hook`` marks each parameter ready;
        once a bucket's parameters are all ready *and every earlier bucket was handed out*,
        ``on_bucket_ready(bucket)`` is called (NOTE: strictly in bucket order, so every rank
        issues its collectives in the same order even when gradients arrive in a different
        order). After the last bucket, ``on_backward_end()`` is queued to run when the
        autograd engine finishes (queue_callback), or called at once outside of backward.
      * ``watch_outputs(output)`` (DDP's forward): the end-of-backward work then runs when the
        backward that reached those outputs finishes, not the one a hook fired in: a hook inside
        a reentrant checkpoint fires in that checkpoint's own backward, which ends first (torch's
        _DDPSink queues its callback from the outputs' backward for the same reason).
      * ``ready_order``: parameter indices in the order their gradients became ready in the
        first complete armed iteration; ``rebuild(order)`` re-buckets in that order (DDP
        broadcasts rank 0's order first so every rank builds identical buckets).
      * ``used[i]``: parameter i got a gradient since ``reset_used()``, armed or not (so usage
        during no_sync counts, as torch's local_used_map does).
    The hooks hold the bucketer weakly: dropping the wrapper frees its buffers and hooks.

ZeRO-2 sketch: ``GradBucketer(params, on_bucket_ready=lambda b: (backend.pack(grads_of(b),
b.buffer, 1 / N), reduce_scatter_tensor(shard_of(b), b.buffer, async_op=True), free grads),
pad_to=N)``; wait for the works in ``on_backward_end``.

Nothing here synchronises with the device or allocates per step, so a captured step
replays the same kernels (see module.py on CUDA graphs).
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

from ..comm.coalesced import MiB, assign_buckets

DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB
DEFAULT_BUCKET_BYTES = 25 * MiB


def _outer_started(ref, grad):
    bucketer = ref()
    if bucketer is not None:
        bucketer._outer_started()

def _hook_via(ref, idx: int, param: torch.Tensor) -> None:
    bucketer = ref()
    if bucketer is not None:
        bucketer._hook(idx, param)


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


class Bucket:
    """One flat buffer's worth of parameters; see the module docstring."""

    def __init__(self, index: int, params: List[torch.Tensor], param_indices: List[int], pad_to: int):
        self.index = index
        self.params = params
        self.param_indices = param_indices          # positions in GradBucketer.params
        self.offsets: List[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.num_grad_elements = n                  # unpadded
        self.numel = int(math.ceil(n / pad_to) * pad_to) if n else 0
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.extra: dict = {}
        self.num_pending = len(params)
        self._views: Optional[List[torch.Tensor]] = None

    def rebind(self, buffer: torch.Tensor) -> None:
        """Move the bucket into `buffer` (same numel and dtype, e.g. symmetric memory): its
        contents are copied and views() is rebuilt over it."""
        if buffer.numel() != self.numel or buffer.dtype != self.dtype:
            raise ValueError(f"Bucket.rebind: expected {self.numel} elements of {self.dtype}, "
                             f"got {buffer.numel()} of {buffer.dtype}")
        buffer.copy_(self.buffer)
        self.buffer = buffer
        self._views = None

    def views(self) -> List[torch.Tensor]:
        """The buffer cut into tensors shaped like the parameters (created once)."""
        if self._views is None:
            self._views = [self.buffer[o: o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]
        return self._views

    def __repr__(self):
        return f"Bucket(index={self.index}, num_params={len(self.params)}, numel={self.numel}, dtype={self.dtype})"


class GradBucketer:
    """Buckets + gradient-ready hooks; see the module docstring."""

    def __init__(self, params: Iterable[torch.Tensor], on_bucket_ready: Callable[[Bucket], None],
                 on_backward_end: Optional[Callable[[], None]] = None, *,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_BYTES, first_bucket_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 param_names: Optional[Dict[torch.Tensor, str]] = None, pad_to: int = 1):
        if not callable(on_bucket_ready):
            raise TypeError(f"GradBucketer: on_bucket_ready must be callable, got {type(on_bucket_ready).__name__}")
        if pad_to < 1:
            raise ValueError(f"GradBucketer: pad_to must be >= 1, got {pad_to}")
        seen = set()
        self.params: List[torch.Tensor] = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("GradBucketer: no parameter requires a gradient")
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        names = param_names or {}
        self.param_names = [names.get(p, f"param[{i}]") for i, p in enumerate(self.params)]
        self.on_bucket_ready = on_bucket_ready
        self.on_backward_end = on_backward_end
        self.bucket_cap_bytes = bucket_cap_bytes
        self.first_bucket_cap_bytes = first_bucket_cap_bytes
        self.pad_to = pad_to
        self.ready_order: List[int] = []            # filled by the first complete armed iteration
        self._recording = True
        self._hooks: list = []
        self._armed = False
        self._started = False                        # a hook fired in the armed backward
        self._ready = [False] * len(self.params)
        self._pending_unused: List[int] = []
        self._early: set = set()                    # mark_ready_early's, in this armed backward
        self._order_now: List[int] = []
        self._stale_error: Optional[List[str]] = None
        # prepare_for_backward(defer=True): called at the end of that backward with which parameters
        # got a gradient, before every bucket is handed out (DDP's static_graph first iteration).
        self.on_deferred_end: Optional[Callable[[List[bool]], None]] = None
        self._deferred = False
        # static_graph: how many times each parameter's hook fires per backward, counted in the deferred
        # first backward (a block run k times under reentrant checkpoints fires k times: each
        # recomputation runs its own backward); later a parameter is ready at its last firing (torch's
        # numGradHooksTriggeredMap). None until then, and without static_graph: ready at the first.
        self.expected_fires: Optional[List[int]] = None
        self._fires = [0] * len(self.params)
        # watch_outputs: the outer backward started (an output's gradient arrived): callbacks wait for
        # its end in _held, run in order by _outer_end
        self._outer = False
        self._held: List[Callable[[], None]] = []
        self.used = [False] * len(self.params)     # a gradient arrived since reset_used(), armed or not
        self.rebuild(list(range(len(self.params) - 1, -1, -1)))

    # ------------------------------------------------------------------ buckets
    def rebuild(self, order: Sequence[int]) -> None:
        """(Re)assign buckets, filling them in `order` (parameter indices, each once).
        Allocates new buffers; callers re-create any per-bucket state afterwards."""
        order = [int(i) for i in order]
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"GradBucketer.rebuild: order must be a permutation of range({len(self.params)}), "
                             f"got {order}")
        groups = assign_buckets([self.params[i] for i in order], self.first_bucket_cap_bytes, self.bucket_cap_bytes)
        self.buckets: List[Bucket] = []
        self._bucket_of = [0] * len(self.params)
        for b_idx, positions in enumerate(groups):
            idxs = [order[pos] for pos in positions]
            self.buckets.append(Bucket(b_idx, [self.params[i] for i in idxs], idxs, self.pad_to))
            for i in idxs:
                self._bucket_of[i] = b_idx
        self._next_bucket = 0

    # ------------------------------------------------------------------ hooks
    def register_hooks(self) -> None:
        if self._hooks:
            return
        # NOTE: the hooks hold the bucketer weakly: a dropped DDP/ZeRO wrapper must free its
        # buffers, and its hooks go with it, even though the parameters live on.
        ref = weakref.ref(self)
        for idx, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(_hook_via, ref, idx)))
        weakref.finalize(self, _remove_handles, list(self._hooks))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, idx: int, param: torch.Tensor) -> None:
        self.used[idx] = True
        if not self._armed:
            return
        self._fires[idx] += 1      # NOTE: counted while marked early too: a later backward may not mark it
        if idx in self._early:
            return
        fires = self._fires[idx]
        if self._deferred:
            if fires == 1:
                self._mark_idx(idx)
            return
        # NOTE: 0: no firing in the first backward (unused, or marked ready early in its place): its
        # first firing marks it, as without static_graph
        expected = 0 if self.expected_fires is None else self.expected_fires[idx]
        if expected and fires != expected:
            if fires < expected:
                return
            raise RuntimeError(
                f"DistributedDataParallel(static_graph=True): parameter '{self.param_names[idx]}' got {fires} "
                f"gradients in this backward, where the first iteration gave it {expected}: static_graph needs "
                "every iteration to use the parameters the same way (pass static_graph=False, with "
                "find_unused_parameters=True if some go unused)")
        self._mark_idx(idx)

    def got_gradient(self, idx: int) -> bool:
        """Whether parameter idx's gradient hook fired in this armed backward."""
        return self._armed and self._fires[idx] > 0

    def mark_ready_early(self, idx: int) -> None:
        """Parameter `idx` is ready before its gradient accumulates (its caller reduces something
        else in its place); its own hook is then ignored for the rest of this backward."""
        self.used[idx] = True
        self._early.add(idx)
        self._mark_idx(idx)

    # ------------------------------------------------------------------ iteration
    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def in_backward(self) -> bool:
        """An armed backward started (a gradient arrived) and has not finished."""
        return self._armed and self._started

    def unready_param_names(self) -> List[str]:
        return [self.param_names[i] for i, r in enumerate(self._ready) if not r]

    def reset_used(self) -> None:
        self.used = [False] * len(self.params)

    def prepare_for_backward(self, unused: Iterable[torch.Tensor] = (), defer: bool = False) -> None:
        """defer: hand nothing out during backward, only note who gets a gradient; at its end call
        on_deferred_end(ready), then hand out every bucket in order (torch's static_graph first
        iteration, whose unused parameters are only known then)."""
        self.check_prior_backward_finished()
        self._ready = [False] * len(self.params)
        for b in self.buckets:
            b.num_pending = len(b.params)
        self._next_bucket = 0
        self._order_now = []
        self._pending_unused = [self._index_of[id(p)] for p in unused if id(p) in self._index_of]
        self._early = set()
        self._fires = [0] * len(self.params)
        self._outer = False
        self._held = []
        self._started = False
        self._deferred = defer
        self._armed = True

    def disarm(self) -> None:
        if self.in_backward:
            # Reported at the next prepare_for_backward, as torch does (not in a no_sync forward).
            self._stale_error = self.unready_param_names()
        self._armed = False
        self._started = False

    def check_prior_backward_finished(self) -> None:
        if self.in_backward:
            self._stale_error = self.unready_param_names()
        if self._stale_error is not None:
            missing, self._stale_error = self._stale_error, None
            self._armed = False
            self._started = False
            raise RuntimeError(
                "Expected to have finished reduction in the prior iteration before starting a new one. "
                "This error indicates that your module has parameters that were not used in producing loss. "
                "Pass find_unused_parameters=True to DistributedDataParallel, or make sure every parameter "
                "that requires grad takes part in computing the output that backward is called on. "
                f"Parameters which did not receive grad: {', '.join(missing)}")

    def mark_ready(self, param: torch.Tensor) -> None:
        """Count `param`'s gradient as ready (called by the hook; callable directly)."""
        idx = self._index_of.get(id(param))
        if idx is None:
            raise ValueError("GradBucketer.mark_ready: tensor is not one of this bucketer's parameters")
        self._mark_idx(idx)

    def _mark_idx(self, idx: int) -> None:
        if not self._started:
            self._started = True
            if self._deferred:
                self._queue(self._end_deferred)
            pending, self._pending_unused = self._pending_unused, []
            for i in pending:
                self._mark(i)
        self._mark(idx)

    def _end_deferred(self) -> None:
        """The end of a deferred backward: the caller learns from who got a gradient, then every
        bucket goes out, in order; the first ready_order is the gradients' order, the rest after."""
        ready, got = list(self._ready), list(self._order_now)
        self._deferred = False
        self.expected_fires = list(self._fires)
        if self.on_deferred_end is not None:
            self.on_deferred_end(ready)
        self._ready = [False] * len(self.params)
        for b in self.buckets:
            b.num_pending = len(b.params)
        self._next_bucket = 0
        self._order_now = got + [i for i, r in enumerate(ready) if not r]
        for b in self.buckets:
            for i in b.param_indices:
                self._mark(i, record=False)

    def _mark(self, idx: int, record: bool = True) -> None:
        if self._ready[idx]:
            raise RuntimeError(
                f"Expected to mark parameter '{self.param_names[idx]}' ready only once per backward. It got a "
                "gradient twice: is it used in a reentrant checkpoint and elsewhere too (use use_reentrant=False, "
                "or static_graph=True, which counts the gradients a parameter gets), or was backward run twice on "
                "one forward? Unused parameters cannot also receive a gradient.")
        self._ready[idx] = True
        if record:
            self._order_now.append(idx)
        if self._deferred:
            return
        bucket = self.buckets[self._bucket_of[idx]]
        bucket.num_pending -= 1
        # NOTE: hand buckets out strictly in order, so all ranks issue collectives alike.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].num_pending == 0:
            b = self.buckets[self._next_bucket]
            self._next_bucket += 1
            self.on_bucket_ready(b)
        if self._next_bucket == len(self.buckets):
            self._queue_end()

    def _queue_end(self) -> None:
        self._queue(self._end)

    def watch_outputs(self, output) -> None:
        """Hook every tensor of `output` (any nesting torch's pytree knows) that autograd will
        reach: the first of them to get its gradient in the next backward queues _outer_end on that
        (outermost) backward. Outputs without such a tensor leave the callbacks where the hooks fire."""
        ref = weakref.ref(self)
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(_outer_started, ref))

    def _outer_started(self) -> None:
        if self._armed and not self._outer:
            self._outer = True
            torch.autograd.Variable._execution_engine.queue_callback(self._outer_end)

    def _outer_end(self) -> None:
        try:
            while self._held:          # NOTE: _end_deferred holds _end here in turn: run in order
                self._held.pop(0)()
        finally:
            self._outer = False

    def _queue(self, callback: Callable[[], None]) -> None:
        if self._outer:
            self._held.append(callback)
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        except RuntimeError:
            # Not inside a backward pass (marked by hand): run it now.
            callback()

    def _end(self) -> None:
        if self._recording:
            self.ready_order = list(self._order_now)
            self._recording = False
        self._armed = False
        self._started = False
        if self.on_backward_end is not None:
            self.on_backward_end()
