"""The re-layout styles of parallelize_module (plan.py), as torch.distributed.tensor.parallel's:
PrepareModuleInput / PrepareModuleOutput re-lay a module's inputs or outputs (an all-gather of the
sequence, a slice of it, or an identity that sums the gradient), the block-level hooks that the
overlaps hang on (grad_overlap.py, batch_overlap.py, async_tp.py).

What DTensor tracks by itself is a rule here: PrepareModuleInput(..., desired Replicate) makes
the module's input whole once (an all-gather of the sequence, or an identity) and sums its
gradient there, once, for all the ColwiseParallel layers that read it (q, k and v share one
collective, as under DTensor). So every reader of that input inside the module must be a
ColwiseParallel layer, as in attention and MLP blocks: a plain op reading it would see its
gradient summed tp times.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..comm import distributed as dist
from . import async_tp, async_tp_allreduce, batch_overlap, grad_overlap
from .comm import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                   scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from .plan import GRAD_REDUCED_BY, STYLE_ATTR, ParallelStyle, is_sequence_dim, layout_of
from .sharding import is_conv1d
from .styles import ColwiseParallel, local_output_only


class PrepareModuleInput(ParallelStyle):
    """Re-lay the module's inputs before its forward: positional args by input_layouts /
    desired_input_layouts, keyword args by the *_kwarg_* dicts (None: leave the arg alone).

    Shard(d) -> Replicate(): all-gather the sequence; Replicate() -> Replicate(): identity. Both
    sum the input's gradient here, once, for the ColwiseParallel layers reading it (see the
    module docstring for what that requires). Replicate() -> Shard(d): keep this rank's slice
    of dim d (entering a sequence-parallel region); its grad is all-gathered.

    use_local_output=True (torch's: the module gets plain tensors, not DTensors): nothing is summed
    here, as under torch; each ColwiseParallel reader sums its own input gradient (one collective
    each), so any op may read the input. Shard(d) -> Replicate() then keeps this rank's slice of
    the gradient in backward.
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False):
        def pairs(src, dst, what):
            src = tuple(src) if isinstance(src, (tuple, list)) else ((src,) if src is not None else ())
            dst = tuple(dst) if isinstance(dst, (tuple, list)) else ((dst,) if dst is not None else ())
            if len(src) != len(dst):
                raise ValueError(f"PrepareModuleInput: {what} layouts {src} and desired {dst} differ in length")
            return [(layout_of(s, what, True), layout_of(d, what, True)) for s, d in zip(src, dst)]

        self.local = use_local_output
        self.arg_layouts = pairs(input_layouts, desired_input_layouts, "input")
        src_kw, dst_kw = dict(input_kwarg_layouts or {}), dict(desired_input_kwarg_layouts or {})
        if src_kw.keys() != dst_kw.keys():
            raise ValueError(f"PrepareModuleInput: input_kwarg_layouts names {sorted(src_kw)} differ from "
                             f"desired_input_kwarg_layouts names {sorted(dst_kw)}")
        self.kwarg_layouts = {k: pairs(src_kw[k], dst_kw[k], f"kwarg {k!r}")[0] for k in src_kw}
        for src, dst in self.arg_layouts + list(self.kwarg_layouts.values()):
            if src is not None and dst is not None and src.is_shard() and dst.is_shard() and src.dim != dst.dim:
                raise ValueError(f"PrepareModuleInput: {src} -> {dst} is not supported (only to or from Replicate())")

    def __repr__(self):
        return f"PrepareModuleInput(args={self.arg_layouts}, kwargs={self.kwarg_layouts})"

    def apply(self, module, name, group, sharded):
        if getattr(module, STYLE_ATTR + "_input", None) is not None:
            raise ValueError(f"{name}: already has a PrepareModuleInput")
        setattr(module, STYLE_ATTR + "_input", self)

        readers = []                 # the ColwiseParallel layers inside, found at the first forward
        def overlapped(layouts):     # async TP for this input: a sequence shard made whole, or replicated
            return async_tp.enabled(sequence_parallel=layouts[0] is not None and layouts[0].is_shard())
        arg_overlap = [overlapped(layouts) for layouts in self.arg_layouts]
        kwarg_overlap = {k: overlapped(layouts) for k, layouts in self.kwarg_layouts.items()}
        overlap_gemm = any(arg_overlap) or any(kwarg_overlap.values())
        chunked = []                 # set by the hook for the forward that follows: (k, where the input is)

        def hook(mod, args, kwargs):
            if any(src is not None for src, _ in self.arg_layouts[len(args):]):
                raise ValueError(f"{name or 'the root module'}: PrepareModuleInput's input_layouts cover "
                                 f"{len(self.arg_layouts)} positional inputs, the call passed {len(args)} (torch "
                                 f"refuses this too); pass them positionally or use input_kwarg_layouts")
            if self.local:           # plain tensors, their gradient summed by each reader (torch's)
                args = tuple(_relayout(a, *self.arg_layouts[i], group, sums_grad=False)
                             if i < len(self.arg_layouts) else a for i, a in enumerate(args))
                kwargs = {k: _relayout(v, *self.kwarg_layouts[k], group, sums_grad=False)
                          if k in self.kwarg_layouts else v for k, v in kwargs.items()}
                return args, kwargs
            # NOTE: `chunked` is left alone while traced (a list mutated in a compiled region is a side
            # effect dynamo replays and guards on).
            if not torch.compiler.is_compiling():
                where = self._batch_chunked(args, kwargs, group)
                if where is not None:    # the forward below re-lays the input per chunk
                    chunked[:] = [where]
                    return args, kwargs
                if chunked:
                    chunked.clear()
            # NOTE: the backward overlap (grad_overlap.py; eager, opt-in) only where one input is made
            # whole here: each reader's weight alias belongs to that input. Never looked at while
            # traced: filling `readers` inside a compiled region would recompile it on the next call.
            overlap, gemm_readers = [], ()
            if overlap_gemm and self._wholes(args, kwargs) == 1:
                # NOTE: found on every call (traced too: a pure walk of the module tree, no state kept).
                gemm_readers = tuple(m for m in _colwise_readers(mod) if getattr(m, STYLE_ATTR).input_layout.is_replicate())
            elif not torch.compiler.is_compiling() and grad_overlap.enabled():
                if not readers:
                    readers.append(_colwise_readers(mod))
                overlap = readers[0] if self._wholes(args, kwargs) == 1 else []
            args = tuple(_relayout(a, *self.arg_layouts[i], group, overlap, gemm_readers if arg_overlap[i] else ())
                         if i < len(self.arg_layouts) else a for i, a in enumerate(args))
            kwargs = {k: _relayout(v, *self.kwarg_layouts[k], group, overlap, gemm_readers if kwarg_overlap[k] else ())
                      if k in self.kwarg_layouts else v for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            if not chunked:
                return inner(*args, **kwargs)
            k, key = chunked.pop()
            return batch_overlap.run_chunked(inner, args, kwargs, key, group, k, name)

        module.forward = forward

    def _batch_chunked(self, args, kwargs, group):
        """(k, the whole input's position or keyword) where this call runs per batch chunk
        (batch_overlap.py: PYNCCL_TP_BATCH_CHUNKS=k, eager, every re-layout Replicate() ->
        Replicate(), one tensor made whole, its dim 0 divisible by k, no argument
        batch_overlap cannot split: a KV cache); else None."""
        if dist.get_world_size(group) == 1:
            return None
        k = batch_overlap.chunks_requested()
        if k == 1 or not batch_overlap.splittable(args, kwargs):
            return None
        places = [(i, a, self.arg_layouts[i]) for i, a in enumerate(args) if i < len(self.arg_layouts)]
        places += [(key, v, self.kwarg_layouts[key]) for key, v in kwargs.items() if key in self.kwarg_layouts]
        wholes = []
        for key, value, (src, dst) in places:
            if src is None or dst is None or not isinstance(value, torch.Tensor):
                continue
            if not (src.is_replicate() and dst.is_replicate()):
                return None          # a gather or a split of the sequence: not chunked (yet)
            wholes.append((key, value))
        if len(wholes) != 1:
            return None
        key, x = wholes[0]
        if x.dim() < 2 or x.shape[0] < k or x.shape[0] % k:
            return None
        return k, key

    def _wholes(self, args, kwargs) -> int:
        """How many tensors this call makes whole (desired Replicate())."""
        pairs = [(a, layouts) for a, layouts in zip(args, self.arg_layouts)]
        pairs += [(v, self.kwarg_layouts[k]) for k, v in kwargs.items() if k in self.kwarg_layouts]
        return sum(isinstance(a, torch.Tensor) and src is not None and dst is not None and dst.is_replicate()
                   for a, (src, dst) in pairs)


def _colwise_readers(module: nn.Module) -> list:
    """The ColwiseParallel linears (nn.Linear, Conv1D) inside `module`: the readers of its input."""
    return [m for m in module.modules() if m is not module and isinstance(getattr(m, STYLE_ATTR, None), ColwiseParallel)
            and (isinstance(m, nn.Linear) or is_conv1d(m))]


def _relayout(x, src, dst, group, readers=(), gemm_readers=(), sums_grad: bool = True):
    """readers: grad_overlap's (eager, opt-in); gemm_readers: async TP's (async_tp.enabled), whose
    outputs are computed here, beside the all-gather of a sequence shard (async_tp.py), or, for a
    replicated x, in one node whose backward overlaps x's gradient all-reduce with their weight
    GEMMs (async_tp_allreduce.py). sums_grad=False (use_local_output=True): a whole x's gradient is
    left to its readers (an identity, or a gather whose backward keeps this rank's slice)."""
    if src is None or dst is None or not isinstance(x, torch.Tensor) or dist.get_world_size(group) == 1:
        return x
    if dst.is_replicate():
        if not src.is_replicate() and not is_sequence_dim(src, x.dim()):
            raise ValueError(f"PrepareModuleInput: {src} -> Replicate() is supported along the sequence, "
                             f"not the last dim, of an input of shape {tuple(x.shape)}")
        seq_dim = None if src.is_replicate() else src.dim % x.dim()
        if not sums_grad:
            return x if seq_dim is None else gather_from_sequence_parallel_region(x, group, grad_is_partial=False,
                                                                                  seq_dim=seq_dim)
        whole = grad_overlap.start(x, group, readers, seq_dim) if readers else None
        # NOTE: only readers whose input width is x's: a ColwiseParallel fed by another layer of the
        # block (a low-rank pair) cannot be computed from x.
        gemm_readers = [(m, m.weight.t() if is_conv1d(m) else m.weight) for m in gemm_readers]
        gemm_readers = [(m, w) for m, w in gemm_readers if w.dim() == 2 and w.shape[1] == x.shape[-1]]
        if seq_dim is not None and gemm_readers:
            x, ys = async_tp.gather_linears(x, [w for _, w in gemm_readers], group, seq_dim)  # (b, s/tp, h) -> (b, s, h)
            async_tp.attach_precomputed(x, [m for m, _ in gemm_readers], ys)
        elif gemm_readers and async_tp_allreduce.worth_it(x, [w for _, w in gemm_readers]):
            # x replicated: its gradient's all-reduce beside the readers' weight GEMMs
            x, ys = async_tp_allreduce.linears(x, [w for _, w in gemm_readers], group)
            async_tp.attach_precomputed(x, [m for m, _ in gemm_readers], ys)
        elif whole is not None:
            x = whole
        elif src.is_replicate():
            x = copy_to_tensor_parallel_region(x, group)
        else:
            x = gather_from_sequence_parallel_region(x, group, grad_is_partial=True, seq_dim=src.dim)
        setattr(x, GRAD_REDUCED_BY, group)
        return x
    if src.is_replicate():
        if is_sequence_dim(dst, x.dim()):
            return scatter_to_sequence_parallel_region(x, group, seq_dim=dst.dim)
        return scatter_to_tensor_parallel_region(x, group)
    return x  # Shard(d) -> Shard(d)


class PrepareModuleOutput(ParallelStyle):
    """Re-lay the module's output (a tensor, or a tuple's leading tensors) after its forward.
    Shard(d) -> Replicate(): all-gather the sequence; the grad coming back is taken to be whole
    (its consumers, e.g. a ColwiseParallel with Replicate() input, sum their own), so backward
    keeps this rank's slice. Use it where the model reshapes a sequence-sharded output on the
    way out (GPT-2 views its final hidden states to the input's sequence length).
    Replicate() -> Shard(d): keep this rank's slice; backward all-gathers. Shard(d) -> Shard(e),
    e another dim (torch: an all-to-all), raises ValueError. use_local_output: True only (torch's
    False returns a DTensor), False raises ValueError."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        local_output_only("PrepareModuleOutput", use_local_output)
        src = output_layouts if isinstance(output_layouts, (tuple, list)) else (output_layouts,)
        dst = desired_output_layouts if isinstance(desired_output_layouts, (tuple, list)) else (desired_output_layouts,)
        if len(src) != len(dst):
            raise ValueError(f"PrepareModuleOutput: output_layouts {src} and desired {dst} differ in length")
        self.layouts = [(layout_of(a, "output", True), layout_of(b, "output", True)) for a, b in zip(src, dst)]

    def __repr__(self):
        return f"PrepareModuleOutput({self.layouts})"

    def apply(self, module, name, group, sharded):
        def relayout(x, src, dst):
            if src is None or dst is None or not isinstance(x, torch.Tensor):
                return x
            if src.is_replicate() == dst.is_replicate():
                if src.is_shard() and src.dim % x.dim() != dst.dim % x.dim():
                    raise ValueError(f"PrepareModuleOutput: {src} -> {dst} is not supported (only to or from "
                                     f"Replicate(), along the sequence)")
                return x
            if dst.is_replicate() and is_sequence_dim(src, x.dim()):
                return gather_from_sequence_parallel_region(x, group, grad_is_partial=False, seq_dim=src.dim)
            if src.is_replicate() and is_sequence_dim(dst, x.dim()):
                return scatter_to_sequence_parallel_region(x, group, seq_dim=dst.dim)
            raise ValueError(f"PrepareModuleOutput: {src} -> {dst} is supported along the sequence only")

        def hook(mod, args, output):
            if isinstance(output, torch.Tensor):
                return relayout(output, *self.layouts[0])
            if isinstance(output, tuple):
                return tuple(relayout(o, *self.layouts[i]) if i < len(self.layouts) else o
                             for i, o in enumerate(output))
            return output

        module.register_forward_hook(hook)
