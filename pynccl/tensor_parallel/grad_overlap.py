"""Backward overlap of a block's summed input gradient with its weight-gradient GEMMs (issue 27,
asynchronous tensor parallelism, eager mode).

PrepareModuleInput (relayout.py) makes a block's input whole once and sums its gradient over the TP
group once, for all the ColwiseParallel layers that read it (q, k and v; gate and up): an
all-reduce, or with sequence parallelism a reduce-scatter of the sequence. Autograd computes each
of those layers' input and weight gradients in one node, and the node that sums the input
gradients runs after all of them: the collective starts once the weight-gradient GEMMs are done
and runs with nothing beside it, while the next op (the norm's backward) waits for it.

Here each such layer's backward is split in two nodes:
  * _LinearInputGrad computes dX = dY W only, and keeps (dY, X);
  * _DeferredWeightGrad, through which the layer reads its weight (an alias), computes
    dW = dY^T X from what the linear kept and returns it as the weight's gradient, so
    AccumulateGrad and every hook on the weight (DDP's, ZeRO's) run as usual.
and the relayout adds two nodes around the block's input: _StartInputGradCollective, whose
backward starts the collective on the summed dX (async) and returns its output, and
_WaitForInputGrad, whose backward orders the compute stream after that collective.

The forward creates them in the order: wait, weight aliases, start (in the relayout), then the
linears (in the block). Autograd's engine runs, of the nodes ready, the one created last first,
so backward runs: the linears (dX), the start of the collective, the weight GEMMs (beside the
collective, on the compute stream), then the wait, then the norm before the block. The values
are the plain path's: the same GEMMs on the same tensors, in another order.

Opt-in (PYNCCL_TP_GRAD_OVERLAP=1): measured slower than the plain path on 2xH100 (eager Llama
1.1B, tp 2: 143.8 and 144.2 ms a step against 140.0, benchmarks/RESULTS.md, session 17). Off (the
plain path of comm.py) also where it cannot or need not act: traced by torch.compile (a Work
cannot be held in a graph), without grad, an input that needs no gradient, or no ColwiseParallel
reader whose weight needs one. A layer that reads the input a second
time in one forward, or whose weight was swapped for another tensor since the relayout (a wrapper
gathering parameters per layer), takes the plain path for that call.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..comm import functional_collectives as fc
from .comm import _all_gather_seq, _reduce_scatter_seq

OVERLAP_ATTR = "_pynccl_tp_grad_overlap"    # tensor attribute: the InputGradOverlap of a relayouted input
ENV = "PYNCCL_TP_GRAD_OVERLAP"


def enabled() -> bool:
    """PYNCCL_TP_GRAD_OVERLAP: 1, or 0 (the default, unset), read at every relayout.
    NOTE: opt-in: measured slower than the plain path on 2xH100, eager Llama 1.1B at tp 2, batch 4
    (143.8-144.2 ms a step against 140.0; benchmarks/RESULTS.md, session 17)."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


class InputGradOverlap:
    """One relayouted input in one forward: its group, the sequence dim it was gathered along (None:
    replicated, the gradient all-reduced), the weight aliases of its readers (by module), what
    each reader's linear kept for its weight gradient, and the collective's Work."""

    def __init__(self, group, seq_dim: Optional[int]):
        self.group, self.seq_dim = group, seq_dim
        self.aliases: dict = {}
        self.kept: dict = {}
        self.work = None


class _WaitForInputGrad(torch.autograd.Function):
    """Identity forward; backward: the compute stream waits for the summed gradient's collective."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        if state.work is not None:
            state.work.wait()
            state.work = None
        return grad, None


class _DeferredWeightGrad(torch.autograd.Function):
    """An alias of a weight; backward returns dW = dY^T X from what the reader's linear kept."""

    @staticmethod
    def forward(ctx, weight, state, key):
        ctx.state, ctx.key = state, key
        # NOTE: the reader's linear returns no gradient for the alias: None here, not a zero tensor
        # of the weight's size made (and added) inside the overlap window.
        ctx.set_materialize_grads(False)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        kept = ctx.state.kept.pop(ctx.key, None)
        if kept is None:                     # the reader's backward did not run (or needed no dW)
            return grad, None, None
        dy, x, transposed, dtype = kept
        dy_2d = dy.reshape(-1, dy.shape[-1])                                    # (tokens, out/tp)
        dw = dy_2d.t().matmul(x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(dtype)  # (out/tp, in)
        if transposed:
            dw = dw.t()                      # Conv1D stores (in, out/tp)
        return (dw if grad is None else dw + grad), None, None


class _StartInputGradCollective(torch.autograd.Function):
    """Forward: the input made whole (identity, or all-gathered along the sequence). Backward:
    starts the collective that sums its gradient over the group and returns its output, which
    _WaitForInputGrad's backward makes the compute stream wait for."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        if state.seq_dim is None:
            return x.view_as(x)
        return _all_gather_seq(x, state.group, state.seq_dim)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        if state.seq_dim is None:
            # NOTE: out of place (a clone): autograd may hand this gradient to other places too.
            out, state.work = fc.all_reduce_async(grad.clone(memory_format=torch.contiguous_format), state.group)
        else:
            out, state.work = _reduce_scatter_seq(grad, state.group, state.seq_dim, async_op=True)
        return out, None


class _LinearInputGrad(torch.autograd.Function):
    """F.linear(x, weight, bias) whose backward computes dX (and the bias's gradient) only; dW is
    _DeferredWeightGrad's. `weight` is the reader's alias, in the module's own layout
    (transposed: Conv1D's (in, out))."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, key, transposed):
        ctx.state, ctx.key, ctx.transposed, ctx.has_bias = state, key, transposed, bias is not None
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight.t() if transposed else weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        w = weight.t() if ctx.transposed else weight                           # (out/tp, in)
        dx = dy.matmul(w.to(dy.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.state.kept[ctx.key] = (dy, x, ctx.transposed, ctx.weight_dtype)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0).to(ctx.weight_dtype)
        return dx, None, db, None, None, None


def start(x: torch.Tensor, group, readers: Sequence[torch.nn.Module], seq_dim: Optional[int] = None):
    """`x` made whole for `readers` (the ColwiseParallel layers reading it; seq_dim: all-gathered
    along that dim, else replicated) with its gradient's collective overlapped in backward, or
    None where the overlap does not apply (the caller then takes comm.py's plain path)."""
    # NOTE: PrepareModuleInput's hook passes readers only in eager mode with the overlap on.
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not x.requires_grad:
        return None
    weights = [(m, m.weight) for m in readers if m.weight.requires_grad]
    if not weights:
        return None
    state = InputGradOverlap(group, seq_dim)
    # NOTE: this creation order (wait, aliases, start) is what orders backward (module docstring).
    x = _WaitForInputGrad.apply(x, state)
    for m, w in weights:
        state.aliases[id(m)] = (_DeferredWeightGrad.apply(w, state, id(m)), w)
    x = _StartInputGradCollective.apply(x, state)
    setattr(x, OVERLAP_ATTR, state)
    return x


def take_alias(x: torch.Tensor, module: torch.nn.Module) -> Optional[Tuple[torch.Tensor, InputGradOverlap]]:
    """(the weight alias `module` reads `x` with, the overlap's state), once per forward; None
    where x carries no overlap for this module (or it was taken already)."""
    state = getattr(x, OVERLAP_ATTR, None)
    if state is None:
        return None
    alias, weight = state.aliases.pop(id(module), (None, None))
    # NOTE: the weight the module holds now, not another one put in place since the relayout (a
    # wrapper that swaps in gathered parameters per layer, as ZeRO-3 may): else the plain path.
    if alias is None or module.weight is not weight:
        return None
    return alias, state


def linear(x: torch.Tensor, alias: torch.Tensor, bias: Optional[torch.Tensor], state: InputGradOverlap,
           module: torch.nn.Module, transposed: bool = False) -> torch.Tensor:
    """F.linear(x, alias (.t() where transposed), bias), its weight gradient left to the alias."""
    return _LinearInputGrad.apply(x, alias, bias, state, id(module), transposed)
