"""Tensor parallelism by plan on an unmodified model (Hugging Face or any nn.Module), mirroring
torch.distributed.tensor.parallel on plain tensors and pynccl groups, with no DTensor:

    model = parallelize_module(model, tp_group, {"model.layers.*.self_attn.q_proj": ColwiseParallel(), ...})

Each style shards the matched module's parameters in place (same names, same module classes, so
the model's own forward, DDP, ZeRO and state_dict keep working) and routes its input and output
through the autograd ops of comm.py. Layouts say where a tensor is split: Shard(1) is the
sequence of Hugging Face's [b, s, h] (sequence parallelism), Shard(-1) the features, Replicate()
the whole tensor on every rank. torch's Shard / Replicate placements are accepted too.

What DTensor tracks by itself is a rule here: PrepareModuleInput(..., desired Replicate) makes
the module's input once (an all-gather of the sequence, or an identity) and sums its gradient
there, once, for all the ColwiseParallel layers that read it (q, k and v share one collective,
as under DTensor). So every reader of that input inside the module must be a ColwiseParallel
layer, as in attention and MLP blocks: a plain op reading it would see its gradient summed
tp times.
"""
from __future__ import annotations

import fnmatch
import functools
import types
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import distributed as dist
from .comm import (allreduce_grads_in_backward, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                   gather_from_tensor_parallel_region, linear_with_tensor_parallel_input,
                   reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
                   scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region)
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import shard_tensor

_GRAD_REDUCED_BY = "_pynccl_tp_grad_reduced_by"  # tensor attribute set by PrepareModuleInput
_STYLE_ATTR = "_pynccl_tp_style"                  # module attribute: the style(s) applied to it
SHARD_SPECS_ATTR = "_pynccl_tp_shard_specs"       # root attribute: {param name: (dim, num_chunks)}


class Shard:
    """The tensor is split along `dim` across the TP group (rank order)."""

    def __init__(self, dim: int):
        self.dim = dim

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return dim is None or dim == self.dim

    def is_replicate(self) -> bool:
        return False

    def __repr__(self):
        return f"Shard({self.dim})"


class Replicate:
    """Every rank holds the whole tensor."""

    def is_shard(self, dim: Optional[int] = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return True

    def __repr__(self):
        return "Replicate()"


def _layout(value, what: str, allow_none: bool = False):
    """Ours or torch's placement (duck-typed: is_shard / is_replicate, .dim)."""
    if value is None and allow_none:
        return None
    if hasattr(value, "is_replicate") and value.is_replicate():
        return Replicate()
    if hasattr(value, "is_shard") and value.is_shard() and isinstance(getattr(value, "dim", None), int):
        return Shard(value.dim)
    raise ValueError(f"{what}: expected Shard(dim) or Replicate(), got {value!r}")


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer storing its weight transposed, (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _is_sequence_dim(layout, ndim: int) -> bool:
    return layout.is_shard() and layout.dim % ndim != ndim - 1


class ParallelStyle:
    """How one module is parallelized. check() runs for every match before anything changes,
    so a size that does not divide leaves the model untouched; apply() changes the module."""

    def check(self, module: nn.Module, name: str, tp_size: int) -> None:
        pass

    def apply(self, module: nn.Module, name: str, group, sharded: Dict[int, nn.Parameter]) -> None:
        raise NotImplementedError


def _check_divisible(name: str, what: str, value: int, tp_size: int, num_chunks: int = 1, hint: str = "") -> None:
    if value % (tp_size * num_chunks):
        by = f"{num_chunks} fused blocks × " if num_chunks > 1 else ""
        raise ValueError(f"{name or 'the root module'}: {what}={value} is not divisible by {by}tp={tp_size}{hint}")


def _shard_param(module: nn.Module, attr: str, dim: int, group, sharded: Dict[int, nn.Parameter],
                 num_chunks: int = 1) -> None:
    """Replace module.<attr> by this rank's slice (a new Parameter, same name). A parameter
    shared with a module already sharded (tied embedding and LM head) gets that same slice."""
    full = module._parameters[attr]
    if id(full) in sharded:
        param = sharded[id(full)]
        if (param.tp_shard_dim, param.tp_num_chunks) != (dim, num_chunks):
            raise ValueError(f"{type(module).__name__}.{attr}: this tied parameter is sharded on dim "
                             f"{param.tp_shard_dim} by another style, but this style needs dim {dim}")
    elif getattr(full, "tp_shard_dim", None) is not None:
        raise ValueError(f"{type(module).__name__}.{attr} is already tensor-parallel (parallelized twice?)")
    else:
        shard = shard_tensor(full.detach(), dim, dist.get_rank(group), dist.get_world_size(group), num_chunks)
        param = nn.Parameter(shard.clone(memory_format=torch.contiguous_format), requires_grad=full.requires_grad)
        param.tp_shard_dim, param.tp_num_chunks = dim, num_chunks
        sharded[id(full)] = param
    module._parameters[attr] = param


def _set_forward(module: nn.Module, style, forward) -> None:
    if getattr(module, _STYLE_ATTR, None) is not None:
        raise ValueError(f"{type(module).__name__} already has a tensor-parallel forward ({getattr(module, _STYLE_ATTR)})")
    setattr(module, _STYLE_ATTR, style)
    module.forward = types.MethodType(forward, module)


def _grad_reduced_upstream(x, group) -> bool:
    return getattr(x, _GRAD_REDUCED_BY, None) is group


class ColwiseParallel(ParallelStyle):
    """nn.Linear / Conv1D with the output features split (nn.Embedding: the embedding dim).

    input_layouts: Replicate() (default; the input grad is all-reduced here, overlapped with the
    weight-grad GEMM, unless a PrepareModuleInput sums it upstream) or Shard(seq_dim) (all-gathered
    here; its grad reduce-scattered). output_layouts: Shard(-1) (default, this rank's features)
    or Replicate() (all-gathered). num_fused: the output holds that many equal blocks, each
    split on its own (GPT-2's fused q|k|v). use_local_output is accepted for torch's signature;
    outputs are always plain tensors.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 num_fused: int = 1):
        self.input_layout = _layout(input_layouts or Replicate(), "ColwiseParallel input_layouts")
        self.output_layout = _layout(output_layouts or Shard(-1), "ColwiseParallel output_layouts")
        if self.output_layout.is_shard() and self.output_layout.dim != -1:
            raise ValueError(f"ColwiseParallel: output_layouts must be Shard(-1) or Replicate(), got {self.output_layout}")
        if num_fused > 1 and self.output_layout.is_replicate():
            raise ValueError(f"ColwiseParallel: a gathered fused output would interleave the blocks rank by rank; "
                             f"num_fused={num_fused} needs output_layouts=Shard(-1)")
        self.num_fused = num_fused

    def __repr__(self):
        return f"ColwiseParallel(input={self.input_layout}, output={self.output_layout}, num_fused={self.num_fused})"

    def check(self, module, name, tp_size):
        if isinstance(module, nn.Embedding):
            _check_divisible(name, "embedding_dim", module.embedding_dim, tp_size)
        elif isinstance(module, nn.Linear):
            _check_divisible(name, "out_features", module.out_features, tp_size, self.num_fused)
        elif _is_conv1d(module):
            _check_divisible(name, "out_features (nf)", module.nf, tp_size, self.num_fused)
        else:
            raise ValueError(f"{name}: ColwiseParallel supports nn.Linear, nn.Embedding and Conv1D, "
                             f"got {type(module).__name__}")

    def apply(self, module, name, group, sharded):
        conv1d = _is_conv1d(module)
        # Linear (out, in) and Embedding (V, h) split dim 0 / 1 of the weight; Conv1D (in, out) dim 1.
        _shard_param(module, "weight", 1 if conv1d or isinstance(module, nn.Embedding) else 0, group, sharded,
                     self.num_fused)
        if getattr(module, "bias", None) is not None:
            _shard_param(module, "bias", 0, group, sharded, self.num_fused)
        style = self

        def forward(mod, x):
            if isinstance(mod, nn.Embedding):
                y = F.embedding(x, mod.weight, mod.padding_idx, mod.max_norm, mod.norm_type, mod.scale_grad_by_freq,
                                mod.sparse)  # (b, s) -> (b, s, h/tp)
            else:
                y = style._linear(x, mod.weight.t() if conv1d else mod.weight, mod.bias, group)
            return gather_from_tensor_parallel_region(y, group) if style.output_layout.is_replicate() else y

        _set_forward(module, self, forward)

    def _linear(self, x, weight, bias, group):
        if _grad_reduced_upstream(x, group):
            if not self.input_layout.is_replicate():
                raise ValueError(f"ColwiseParallel(input_layouts={self.input_layout}): the input was made "
                                 f"Replicate() by a PrepareModuleInput; declare input_layouts=Replicate()")
            return F.linear(x, weight, bias)  # (.., in) @ (in, out/tp): its input grad is summed upstream
        if self.input_layout.is_replicate():
            return linear_with_tensor_parallel_input(x, weight, bias, group)
        # (b, s/tp, in) -> all-gather the sequence -> (b, s, out/tp)
        return linear_with_tensor_parallel_input(x, weight, bias, group, sequence_parallel=True,
                                                 seq_dim=self.input_layout.dim)


class RowwiseParallel(ParallelStyle):
    """nn.Linear / Conv1D with the input features split; the partial outputs are summed
    (output_layouts Replicate(): all-reduce, default; Shard(seq_dim): reduce-scatter along the
    sequence) and the bias added once, after the sum. input_layouts: Shard(-1) (default, the
    output of a ColwiseParallel layer) or Replicate() (sliced here).
    nn.Embedding: the vocabulary is split (rows); each rank looks up its own token ids and the
    sum over ranks is the lookup (input_layouts Replicate(): the token ids)."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        self.input_layout = _layout(input_layouts, "RowwiseParallel input_layouts", allow_none=True)
        self.output_layout = _layout(output_layouts or Replicate(), "RowwiseParallel output_layouts")

    def __repr__(self):
        return f"RowwiseParallel(input={self.input_layout}, output={self.output_layout})"

    def check(self, module, name, tp_size):
        if isinstance(module, nn.Embedding):
            _check_divisible(name, "num_embeddings", module.num_embeddings, tp_size,
                             hint=" (pad the vocabulary: model.resize_token_embeddings(n, pad_to_multiple_of=tp))")
            if module.max_norm is not None or module.sparse:
                raise ValueError(f"{name}: RowwiseParallel supports neither max_norm nor sparse embeddings")
        elif isinstance(module, nn.Linear):
            _check_divisible(name, "in_features", module.in_features, tp_size)
        elif _is_conv1d(module):
            _check_divisible(name, "in_features (nx)", module.nx, tp_size)
        else:
            raise ValueError(f"{name}: RowwiseParallel supports nn.Linear, nn.Embedding and Conv1D, "
                             f"got {type(module).__name__}")

    def apply(self, module, name, group, sharded):
        embedding, conv1d = isinstance(module, nn.Embedding), _is_conv1d(module)
        # Linear (out, in): dim 1; Conv1D (in, out) and Embedding (V, h): dim 0. The bias stays whole.
        _shard_param(module, "weight", 0 if embedding or conv1d else 1, group, sharded)
        tp_rank = dist.get_rank(group)
        style = self
        if embedding:
            rows = module.num_embeddings // dist.get_world_size(group)
            start = tp_rank * rows
            pad = module.padding_idx
            local_pad = pad - start if pad is not None and start <= pad < start + rows else None

            def forward(mod, tokens):
                outside = (tokens < start) | (tokens >= start + rows)
                local = (tokens - start).masked_fill(outside, 0)
                # (b, s) -> (b, s, h): rows of this rank's tokens, zeros elsewhere; the sum over ranks is the lookup.
                y = F.embedding(local, mod.weight, local_pad).masked_fill(outside.unsqueeze(-1), 0.0)
                return style._reduce(y, None, group)
        else:
            def forward(mod, x):
                if style.input_layout is not None and style.input_layout.is_replicate():
                    x = scatter_to_tensor_parallel_region(x, group)  # (.., in) -> (.., in/tp)
                y = F.linear(x, mod.weight.t() if conv1d else mod.weight)  # (.., in/tp) -> (.., out), a partial sum
                return style._reduce(y, getattr(mod, "bias", None), group)

        _set_forward(module, self, forward)

    def _reduce(self, y, bias, group):
        if self.output_layout.is_replicate():
            y = reduce_from_tensor_parallel_region(y, group, inplace=True)  # y is fresh: reduce in place
        else:
            y = reduce_scatter_to_sequence_parallel_region(y, group, seq_dim=self.output_layout.dim)
            if bias is not None:  # now meets only this rank's tokens: its grad is a partial sum
                bias, = allreduce_grads_in_backward((bias,), group)
        return y if bias is None else y + bias


def _swap_in(module: nn.Module, places, tensors):
    """Make each (submodule, attr) read the given tensor; returns what to restore."""
    saved = []
    for (sub, attr), t in zip(places, tensors):
        saved.append((sub, attr, sub.__dict__.get(attr, _MISSING)))
        sub.__dict__[attr] = t  # shadows _parameters (or what ZeRO installed) for this call
    return saved


_MISSING = object()


class SequenceParallel(ParallelStyle):
    """A module with replicated parameters (a norm) run on this rank's sequence shard: its input
    is taken to be the shard already, and its parameters' grads, each a partial sum over this
    rank's tokens, are summed over the TP group in backward (one collective per module call).
    The module's own forward runs unchanged, with its parameters read through that sum."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim

    def __repr__(self):
        return f"SequenceParallel(sequence_dim={self.sequence_dim})"

    def apply(self, module, name, group, sharded):
        places = [(sub, attr) for sub in module.modules() for attr, p in sub._parameters.items() if p is not None]
        inner = module.forward

        def forward(mod, *args, **kwargs):
            current = [getattr(sub, attr) for sub, attr in places]  # Parameters, or what ZeRO installed
            wanted = [i for i, t in enumerate(current) if t.requires_grad]
            summed = allreduce_grads_in_backward([current[i] for i in wanted], group)
            for i, t in zip(wanted, summed):
                current[i] = t
            saved = _swap_in(mod, places, current)
            try:
                return inner(*args, **kwargs)
            finally:
                for sub, attr, old in saved:
                    if old is _MISSING:
                        del sub.__dict__[attr]
                    else:
                        sub.__dict__[attr] = old

        _set_forward(module, self, forward)


class PrepareModuleInput(ParallelStyle):
    """Re-lay the module's inputs before its forward: positional args by input_layouts /
    desired_input_layouts, keyword args by the *_kwarg_* dicts (None: leave the arg alone).

    Shard(d) -> Replicate(): all-gather the sequence; Replicate() -> Replicate(): identity. Both
    sum the input's gradient here, once, for the ColwiseParallel layers reading it (see the
    module docstring for what that requires). Replicate() -> Shard(d): keep this rank's slice
    of dim d (entering a sequence-parallel region); its grad is all-gathered.
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False):
        def pairs(src, dst, what):
            src = tuple(src) if isinstance(src, (tuple, list)) else ((src,) if src is not None else ())
            dst = tuple(dst) if isinstance(dst, (tuple, list)) else ((dst,) if dst is not None else ())
            if len(src) != len(dst):
                raise ValueError(f"PrepareModuleInput: {what} layouts {src} and desired {dst} differ in length")
            return [(_layout(s, what, True), _layout(d, what, True)) for s, d in zip(src, dst)]

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
        if getattr(module, _STYLE_ATTR + "_input", None) is not None:
            raise ValueError(f"{name}: already has a PrepareModuleInput")
        setattr(module, _STYLE_ATTR + "_input", self)

        def hook(mod, args, kwargs):
            args = tuple(_relayout(a, *self.arg_layouts[i], group) if i < len(self.arg_layouts) else a
                         for i, a in enumerate(args))
            kwargs = {k: _relayout(v, *self.kwarg_layouts[k], group) if k in self.kwarg_layouts else v
                      for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)


def _relayout(x, src, dst, group):
    if src is None or dst is None or not isinstance(x, torch.Tensor) or dist.get_world_size(group) == 1:
        return x
    if dst.is_replicate():
        if src.is_replicate():
            x = copy_to_tensor_parallel_region(x, group)
        elif _is_sequence_dim(src, x.dim()):
            x = gather_from_sequence_parallel_region(x, group, grad_is_partial=True, seq_dim=src.dim)
        else:
            raise ValueError(f"PrepareModuleInput: {src} -> Replicate() is supported along the sequence, "
                             f"not the last dim, of an input of shape {tuple(x.shape)}")
        setattr(x, _GRAD_REDUCED_BY, group)
        return x
    if src.is_replicate():
        if _is_sequence_dim(dst, x.dim()):
            return scatter_to_sequence_parallel_region(x, group, seq_dim=dst.dim)
        return scatter_to_tensor_parallel_region(x, group)
    return x  # Shard(d) -> Shard(d)


class PrepareModuleOutput(ParallelStyle):
    """Re-lay the module's output (a tensor, or a tuple's leading tensors) after its forward.
    Shard(d) -> Replicate(): all-gather the sequence; the grad coming back is taken to be whole
    (its consumers, e.g. a ColwiseParallel with Replicate() input, sum their own), so backward
    keeps this rank's slice. Use it where the model reshapes a sequence-sharded output on the
    way out (GPT-2 views its final hidden states to the input's sequence length).
    Replicate() -> Shard(d): keep this rank's slice; backward all-gathers."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        src = output_layouts if isinstance(output_layouts, (tuple, list)) else (output_layouts,)
        dst = desired_output_layouts if isinstance(desired_output_layouts, (tuple, list)) else (desired_output_layouts,)
        if len(src) != len(dst):
            raise ValueError(f"PrepareModuleOutput: output_layouts {src} and desired {dst} differ in length")
        self.layouts = [(_layout(a, "output", True), _layout(b, "output", True)) for a, b in zip(src, dst)]

    def __repr__(self):
        return f"PrepareModuleOutput({self.layouts})"

    def apply(self, module, name, group, sharded):
        def relayout(x, src, dst):
            if src is None or dst is None or not isinstance(x, torch.Tensor) or src.is_replicate() == dst.is_replicate():
                return x
            if dst.is_replicate() and _is_sequence_dim(src, x.dim()):
                return gather_from_sequence_parallel_region(x, group, grad_is_partial=False, seq_dim=src.dim)
            if src.is_replicate() and _is_sequence_dim(dst, x.dim()):
                return scatter_to_sequence_parallel_region(x, group, seq_dim=dst.dim)
            raise ValueError(f"PrepareModuleOutput: {src} -> {dst} is supported along the sequence only")

        def hook(mod, args, output):
            if isinstance(output, torch.Tensor):
                return relayout(output, *self.layouts[0])
            if isinstance(output, tuple):
                return tuple(relayout(o, *self.layouts[i]) if i < len(self.layouts) else o for i, o in enumerate(output))
            return output

        module.register_forward_hook(hook)


class LocalHeads(ParallelStyle):
    """An attention module whose heads are split by its projections: checks that the head
    counts divide (config_attributes, read from module.config: num_attention_heads,
    num_key_value_heads) and divides integer attributes its forward reads as global sizes
    (attributes, e.g. GPT-2's split_size, num_heads, embed_dim) by the TP size."""

    def __init__(self, *, attributes: Sequence[str] = (), config_attributes: Sequence[str] = ()):
        self.attributes, self.config_attributes = tuple(attributes), tuple(config_attributes)

    def __repr__(self):
        return f"LocalHeads(attributes={self.attributes}, config_attributes={self.config_attributes})"

    def check(self, module, name, tp_size):
        config = getattr(module, "config", None)
        for attr in self.config_attributes:
            value = getattr(config, attr, None)
            if not isinstance(value, int):
                raise ValueError(f"{name}: LocalHeads needs module.config.{attr} (an int), got {value!r}")
            _check_divisible(name, attr, value, tp_size)
        for attr in self.attributes:
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                raise ValueError(f"{name}: LocalHeads needs an int attribute {attr!r}, got {value!r}")
            _check_divisible(name, attr, value, tp_size)

    def apply(self, module, name, group, sharded):
        for attr in self.attributes:
            setattr(module, attr, getattr(module, attr) // dist.get_world_size(group))


def vocab_parallel_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                                  shift_labels=None, *, group=None, **kwargs) -> torch.Tensor:
    """Hugging Face's ForCausalLMLoss on logits split along the vocabulary (b, s, V/tp), never
    gathering them: the same shift, ignore_index and num_items_in_batch, with
    vocab_parallel_cross_entropy (fp32) in place of F.cross_entropy."""
    tp_size = dist.get_world_size(group)
    if logits.shape[-1] * tp_size != vocab_size:
        raise ValueError(f"vocab_parallel_causal_lm_loss: logits of shape {tuple(logits.shape)} × tp={tp_size} do "
                         f"not cover vocab_size={vocab_size}; the LM head must be ColwiseParallel(output_layouts="
                         f"Shard(-1))")
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)  # tokens < n predict n
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), target, group, ignore_index, reduction)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return loss


class LossParallel(ParallelStyle):
    """On a Hugging Face *ForCausalLM: its loss_function becomes vocab_parallel_causal_lm_loss,
    so `model(input_ids=x, labels=x).loss` never gathers the logits (out.logits is this rank's
    vocabulary slice). Needs the LM head ColwiseParallel(output_layouts=Shard(-1))."""

    def __repr__(self):
        return "LossParallel()"

    def check(self, module, name, tp_size):
        if not isinstance(getattr(type(module), "loss_function", None), property):
            raise ValueError(f"{name or 'the root module'}: LossParallel needs a Hugging Face model with a "
                             f"settable loss_function, got {type(module).__name__}")

    def apply(self, module, name, group, sharded):
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        head_style = getattr(head, _STYLE_ATTR, None)
        if not (isinstance(head_style, ColwiseParallel) and head_style.output_layout.is_shard()):
            raise ValueError(f"LossParallel: the LM head must be ColwiseParallel(output_layouts=Shard(-1)), "
                             f"found {head_style!r} on {type(head).__name__}")
        module.loss_function = functools.partial(vocab_parallel_causal_lm_loss, group=group)


Plan = Mapping[str, Union[ParallelStyle, Sequence[ParallelStyle]]]


def _matches(pattern: str, name: str) -> bool:
    """Glob per dotted atom, as torch's parallelize_module: 'layers.*.mlp' matches 'layers.3.mlp'
    but not 'layers.3.block.mlp'. The empty pattern is the root module."""
    if pattern == "" or name == "":
        return pattern == name
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatchcase(p, a) for a, p in zip(atoms, parts))


def parallelize_module(module: nn.Module, tp_group, plan: Union[Plan, ParallelStyle]) -> nn.Module:
    """Apply `plan` ({glob pattern of submodule names: style or tuple of styles}, or one style for
    `module` itself) over `tp_group` (a pynccl ProcessGroup; None: the default group). Collective
    in effect: every rank of the group must apply the same plan. Modifies `module` in place and
    returns it. Raises ValueError, before changing anything, for a size that does not divide.
    Patterns matching no module are reported with a warning (a pipeline stage may lack some)."""
    if isinstance(plan, ParallelStyle):
        plan = {"": plan}
    if getattr(module, SHARD_SPECS_ATTR, None) is not None:
        raise ValueError(f"parallelize_module: {type(module).__name__} is already tensor-parallel")
    tp_size = dist.get_world_size(tp_group)
    named = list(module.named_modules())
    work = []
    for pattern, styles in plan.items():
        styles = tuple(styles) if isinstance(styles, (tuple, list)) else (styles,)
        for style in styles:
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"parallelize_module: plan[{pattern!r}] must be a ParallelStyle, got {style!r}")
        hits = [(name, mod) for name, mod in named if _matches(pattern, name)]
        if not hits:
            import warnings
            warnings.warn(f"parallelize_module: plan key {pattern!r} matches no submodule of {type(module).__name__}")
        work += [(name, mod, style) for name, mod in hits for style in styles]
    for name, mod, style in work:
        style.check(mod, name, tp_size)
    sharded: Dict[int, nn.Parameter] = {}
    for name, mod, style in sorted(work, key=lambda w: w[0] == ""):  # root styles (the loss) last
        if tp_size > 1 or isinstance(style, LocalHeads):
            style.apply(mod, name, tp_group, sharded)
    specs = {name: (p.tp_shard_dim, p.tp_num_chunks) for name, p in module.named_parameters(remove_duplicate=False)
             if getattr(p, "tp_shard_dim", None) is not None}
    setattr(module, SHARD_SPECS_ATTR, specs)
    return module


def shard_specs(module: nn.Module) -> Dict[str, Tuple[int, int]]:
    """{parameter name: (shard dim, fused blocks)} of a module returned by parallelize_module."""
    specs = getattr(module, SHARD_SPECS_ATTR, None)
    if specs is None:
        raise ValueError(f"{type(module).__name__} was not returned by parallelize_module")
    return specs
