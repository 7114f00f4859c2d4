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

What a capture fixes: the input shapes/dtypes/requires_grad, the non-tensor arguments, the autocast
state (captured with its weight cache off: graphs recast weights every replay) and the parameter
set. A later micro-batch that differs raises instead of replaying a stale graph. Not for modules
whose forward syncs with the host or branches on data (nothing can be captured there).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn


def _signature(args: Sequence, params: Sequence[torch.Tensor]) -> tuple:
    """What a capture is valid for (see the module docstring)."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(("tensor", tuple(a.shape), a.dtype, a.requires_grad, str(a.device)))
        else:
            parts.append(("value", repr(a)))
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return tuple(parts), autocast, tuple(p.data_ptr() for p in params)


def _describe(sig: tuple) -> str:
    args, (ac_on, ac_dtype), _ = sig
    shown = []
    for kind, *rest in args:
        if kind == "tensor":
            shape, dtype, grad, _device = rest
            shown.append(f"{shape} {str(dtype).replace('torch.', '')}{' requires_grad' if grad else ''}")
        else:
            shown.append(rest[0])
    return f"inputs [{', '.join(shown)}], autocast {str(ac_dtype).replace('torch.', '') if ac_on else 'off'}"


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

            def run():
                return _as_outputs(torch.func.functional_call(module, aliases, tuple(self.static_args)))
            self.tensor_idx = [i for i, a in enumerate(self.static_args) if isinstance(a, torch.Tensor)]
            grad_inputs = [self.static_args[i] for i in self.tensor_idx if self.static_args[i].requires_grad]
            targets = grad_inputs + leaves
            # One eager run first, on the capture stream: lazy initialisation (cuBLAS workspaces,
            # kernel selection) must not happen inside the capture. autograd.grad leaves .grad alone.
            outs = run()
            diff = [o for o in outs if o.requires_grad]
            if diff and targets:
                torch.autograd.grad(diff, targets, [torch.zeros_like(o) for o in diff], allow_unused=True)
            del outs, diff
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


def _as_outputs(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    raise TypeError(f"pipeline stage (cuda_graph=True): the module must return a tensor or a tuple of tensors, "
                    f"got {type(out).__name__}")


class _Replay(torch.autograd.Function):
    """Autograd node of one slot: forward replays the forward graph, backward the backward graph."""

    @staticmethod
    def forward(ctx, slot: _Slot, params: List[torch.Tensor], *tensors):
        for i, t in zip(slot.tensor_idx, tensors):
            static = slot.static_args[i]
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        slot.fwd.replay()
        ctx.slot, ctx.params = slot, params
        outs = tuple(o.detach() for o in slot.static_outs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, slot.differentiable) if not d])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        slot = ctx.slot
        for static, g in zip(slot.static_grad_outs, [g for g, d in zip(grads, slot.differentiable) if d]):
            static.copy_(g)
        slot.bwd.replay()
        # Input grads are sent to the previous stage: copies, so the slot's next replay cannot race a
        # send. Parameter grads: autograd adds them in place into an existing .grad, but adopts the
        # tensor itself where .grad is None, so that first one must be a copy too.
        in_grads = iter(slot.static_input_grads)
        per_tensor = []
        for needs in slot.grad_input_mask:
            g = next(in_grads) if needs else None
            per_tensor.append(None if g is None else g.clone())
        param_grads = [None if g is None else (g.clone() if p.grad is None else g)
                       for p, g in zip(ctx.params, slot.static_param_grads)]
        return (None, None, *per_tensor, *param_grads)


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
        self._by_mb: Dict[int, _Slot] = {}

    def __call__(self, mb: int, args: Sequence) -> Tuple[torch.Tensor, ...]:
        sig = _signature(args, self.params)
        if self.signature is None:
            self.signature = sig
        elif sig != self.signature:
            if sig[2] != self.signature[2]:
                raise RuntimeError("pipeline stage (cuda_graph=True): a parameter's storage changed since the "
                                   "stage was captured (e.g. `p.data = ...`); the graphs read the old one. Update "
                                   "parameters in place (as torch optimizers do) or build the stage anew")
            raise ValueError(f"pipeline stage (cuda_graph=True): micro-batch {mb} has {_describe(sig)}, but the "
                             f"stage's graphs were captured for {_describe(self.signature)}; every micro-batch of "
                             f"every step must match, or build the stage with cuda_graph=False")
        if mb in self._by_mb:
            raise RuntimeError(f"pipeline stage (cuda_graph=True): forward of micro-batch {mb} again before its "
                               f"backward")
        slot = next((s for s in self.slots if s.microbatch is None), None)
        if slot is None:
            slot = _Slot(self.module, args, self.names, self.params, self.stream)
            self.slots.append(slot)
        slot.microbatch = mb
        self._by_mb[mb] = slot
        tensors = [args[i] for i in slot.tensor_idx]
        return _Replay.apply(slot, self.params, *tensors, *self.params)

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
