"""CUDA-graphed pipeline stages: a stage module's forward and backward captured once and replayed for
every micro-batch (PipelineStage(..., cuda_graph=True)).

Why: an eager stage of an HF model spends about as long on the host issuing a micro-batch's kernels
as the GPU spends running them (benchmarks/pp_stage_cost.py: 13.4 ms of host for 13.8 ms of GPU on a
4-layer Llama-1B stage), so every host hiccup stalls the pipeline. A replay costs ~2 ms of host.

How: a graph's saved activations live in its own memory, so one forward/backward graph pair (a
"slot") serves one micro-batch at a time, from its forward to its backward. A stage keeps as many
slots as it has micro-batches in flight (1F1B: p - rank; GPipe: all of them), captured on first use,
each in its own memory pool. The graphs read the parameters in place (an optimizer must update them
in place, as torch's do) and hand their gradients to autograd, which accumulates them into .grad as
usual; gradients of the stage's inputs are copies, so a send can never see a later replay's values.

What a capture fixes: the input shapes/dtypes/requires_grad/device, the non-tensor arguments, the
autocast state (captured with its weight cache off: graphs recast weights every replay), grad mode,
every submodule's training flag, and the storage and requires_grad of every parameter and buffer.
A later micro-batch that differs raises instead of replaying a stale graph. Not for modules whose
forward syncs with the host or branches on data (nothing can be captured there), nor for modules
that communicate or reshape parameters in forward (DDP and ZeRO wrappers are refused).

Side effects of a capture: each slot runs the module once eagerly first (lazy initialisation must
not happen inside a capture), so buffers a forward updates (BatchNorm statistics) and the RNG move
once more per slot, in the first step; entering a capture synchronises the device (torch.cuda.graph)
once per slot, in the first step, which the schedules allow: schedule_checker proves them free of
deadlock even when every batch of sends and receives blocks until its peers have matched it.

Why the static outputs may be handed to a send: a slot is reused only after its micro-batch's
backward, which waits for the gradients of those outputs to arrive from the next stage, and the
next stage sends them only after receiving the outputs; outputs that get no gradient back
(non-differentiable ones) are copies.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .p2p import as_tensor_tuple, container_of


def _signature(args: Sequence, module: nn.Module) -> tuple:
    """What a capture is valid for (see the module docstring): (inputs, context, module state)."""
    inputs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            inputs.append(("tensor", tuple(a.shape), a.dtype, a.requires_grad, str(a.device)))
        else:
            inputs.append(("value", repr(a)))
    context = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_grad_enabled())
    state = (tuple(m.training for m in module.modules()),
             tuple((p.data_ptr(), p.requires_grad) for p in module.parameters()),
             tuple(b.data_ptr() for b in module.buffers()))
    return tuple(inputs), context, state


_STATE_PARTS = ("a submodule's training/eval mode", "a parameter's storage or requires_grad", "a buffer's storage")


def check_signature(captured: tuple, now: tuple, mb: int) -> None:
    """Raise if micro-batch mb's signature differs from the one the stage's graphs were captured for."""
    if now == captured:
        return
    changed = [what for what, a, b in zip(_STATE_PARTS, captured[2], now[2]) if a != b]
    if changed:
        raise RuntimeError(f"pipeline stage (cuda_graph=True): {' and '.join(changed)} changed since the stage "
                           f"was captured, and its graphs would replay the old one. Update parameters in place "
                           f"(as torch optimizers do, not `p.data = ...`), keep the mode and the trainable "
                           f"parameters as they were, or build the stage anew")
    raise ValueError(f"pipeline stage (cuda_graph=True): micro-batch {mb} has {_describe(now)}, but the stage's "
                     f"graphs were captured for {_describe(captured)}; every micro-batch of every step must "
                     f"match, or build the stage with cuda_graph=False")


def _describe(sig: tuple) -> str:
    inputs, (ac_on, ac_dtype, grad_on), _ = sig
    shown = []
    for kind, *rest in inputs:
        if kind == "tensor":
            shape, dtype, grad, device = rest
            shown.append(f"{shape} {str(dtype).replace('torch.', '')}{' requires_grad' if grad else ''} on {device}")
        else:
            shown.append(rest[0])
    autocast = str(ac_dtype).replace('torch.', '') if ac_on else 'off'
    return f"inputs [{', '.join(shown)}], autocast {autocast}, grad mode {'on' if grad_on else 'off'}"


class _Slot:
    """One captured forward/backward pair and the static tensors it reads and writes."""

    def __init__(self, module: nn.Module, args: Sequence, names: List[str], params: List[torch.Tensor],
                 stream: torch.cuda.Stream):
        self.pool = torch.cuda.graph_pool_handle()
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        ac_on, ac_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.autocast("cuda", dtype=ac_dtype, enabled=ac_on, cache_enabled=False):
            # Everything autograd sees in a capture is made here, on the capture stream: static inputs,
            # and fresh leaves that alias the parameters' storage (the graphs read the parameters in
            # place). An autograd node made earlier on another stream (a parameter's AccumulateGrad
            # kept alive elsewhere) would make that stream wait on the capture, which CUDA refuses.
            self.static_args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                                else a for a in args]
            aliases = {n: p.detach().requires_grad_(True) for n, p in zip(names, params)}
            leaves = list(aliases.values())

            def call():
                return torch.func.functional_call(module, aliases, tuple(self.static_args))

            def run():
                return as_tensor_tuple(call())
            self.tensor_idx = [i for i, a in enumerate(self.static_args) if isinstance(a, torch.Tensor)]
            grad_inputs = [self.static_args[i] for i in self.tensor_idx if self.static_args[i].requires_grad]
            targets = grad_inputs + leaves
            # One eager run first, on the capture stream: lazy initialisation (cuBLAS workspaces,
            # kernel selection) must not happen inside the capture. autograd.grad leaves .grad alone.
            returned = call()
            self.container = container_of(returned)     # a replay hands back the tensors only
            outs = as_tensor_tuple(returned)
            diff = [o for o in outs if o.requires_grad]
            if diff and targets:
                torch.autograd.grad(diff, targets, [torch.zeros_like(o) for o in diff], allow_unused=True)
            del returned, outs, diff
            with torch.cuda.graph(self.fwd, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                outs = run()
            self.differentiable = [o.requires_grad for o in outs]
            diff = [o for o in outs if o.requires_grad]
            self.static_grad_outs = [torch.empty_like(o) for o in diff]
            with torch.cuda.graph(self.bwd, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(diff, targets, self.static_grad_outs, allow_unused=True) \
                    if diff and targets else [None] * len(targets)
        torch.cuda.current_stream().wait_stream(stream)
        self.static_outs = [o.detach() for o in outs]
        self.static_input_grads = list(grads[:len(grad_inputs)])
        self.static_param_grads = list(grads[len(grad_inputs):])
        self.grad_input_mask = [self.static_args[i].requires_grad for i in self.tensor_idx]
        self.microbatch: Optional[int] = None        # the micro-batch whose activations it holds


class _Replay(torch.autograd.Function):
    """Autograd node of one slot: forward replays the forward graph, backward the backward graph."""

    @staticmethod
    def forward(ctx, slot: _Slot, *tensors):
        """tensors: the tensor arguments (slot.tensor_idx order), then the parameters."""
        for i, t in zip(slot.tensor_idx, tensors):
            slot.static_args[i].copy_(t)
        slot.fwd.replay()
        ctx.slot, ctx.params = slot, tensors[len(slot.tensor_idx):]
        # Non-differentiable outputs are copies: no gradient comes back for them, so nothing orders a
        # send of them before the slot's next replay (see the module docstring).
        outs = tuple(o.detach() if d else o.clone() for o, d in zip(slot.static_outs, slot.differentiable))
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, slot.differentiable) if not d])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        slot = ctx.slot
        for static, g in zip(slot.static_grad_outs, [g for g, d in zip(grads, slot.differentiable) if d]):
            static.copy_(g)
        slot.bwd.replay()
        # Input grads are sent to the previous stage: copies, so the slot's next replay cannot race a
        # send. Parameter grads: autograd adds them in place into an existing .grad; where .grad is
        # None it would copy a buffer the slot still holds, so hand it a copy it can adopt instead
        # (one copy either way, but .grad never aliases the slot's memory, whatever autograd does).
        in_grads = iter(slot.static_input_grads)
        per_tensor = []
        for needs in slot.grad_input_mask:
            g = next(in_grads) if needs else None
            per_tensor.append(None if g is None else g.clone())
        param_grads = [None if g is None else (g.clone() if p.grad is None else g)
                       for p, g in zip(ctx.params, slot.static_param_grads)]
        return (None, *per_tensor, *param_grads)


class StageGraphs:
    """The slots of one stage module (see the module docstring)."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module = module
        self.device = device
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]   # tied ones once
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.stream = torch.cuda.Stream(device=device)
        self.slots: List[_Slot] = []
        self.signature: Optional[tuple] = None
        self.container = None       # how the module returned its outputs (p2p.container_of), once captured
        self._by_mb: Dict[int, _Slot] = {}

    def __call__(self, mb: int, args: Sequence) -> Tuple[torch.Tensor, ...]:
        sig = _signature(args, self.module)
        if self.signature is not None:
            check_signature(self.signature, sig, mb)
        if mb in self._by_mb:
            raise RuntimeError(f"pipeline stage (cuda_graph=True): forward of micro-batch {mb} again before its "
                               f"backward")
        slot = next((s for s in self.slots if s.microbatch is None), None)
        if slot is None:
            try:
                slot = _Slot(self.module, args, self.names, self.params, self.stream)
            except Exception as e:
                raise RuntimeError(f"pipeline stage (cuda_graph=True): capturing the stage module's forward and "
                                   f"backward as CUDA graphs failed ({type(e).__name__}: {e}). The module must "
                                   f"not synchronise with the host or branch on data in forward or backward; "
                                   f"build the stage with cuda_graph=False to run it eagerly") from e
            self.slots.append(slot)
            self.signature, self.container = sig, slot.container
        slot.microbatch = mb
        self._by_mb[mb] = slot
        tensors = [args[i] for i in slot.tensor_idx]
        return _Replay.apply(slot, *tensors, *self.params)

    def release(self, mb: int) -> None:
        """After micro-batch mb's backward: its slot may serve the next micro-batch."""
        slot = self._by_mb.pop(mb, None)
        if slot is not None:
            slot.microbatch = None

    def reset(self) -> None:
        """A new step: slots of micro-batches that never ran backward (a failed step) are free again."""
        for slot in self.slots:
            slot.microbatch = None
        self._by_mb.clear()
