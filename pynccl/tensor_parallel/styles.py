"""The parallel styles of parallelize_module (plan.py), as torch.distributed.tensor.parallel's:
ColwiseParallel / RowwiseParallel shard nn.Linear, nn.Embedding and Hugging Face's Conv1D with
the Megatron-layout layers' own sharding (sharding.py) and replace their forward by the same
functions as those layers (sharded_ops.py), the layouts mapped onto their arguments; SequenceParallel runs a module
with replicated parameters on a sequence shard; LocalHeads makes an attention module's head
counts per-rank; AllPositionLogits refuses a partial logits_to_keep where the LM head's input is a
token shard. PrepareModuleInput / PrepareModuleOutput, which re-lay a module's inputs or
outputs, are in relayout.py.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import distributed as dist
from . import async_tp, async_tp_allreduce, grad_overlap
from .comm import (allreduce_grads_in_backward, gather_from_sequence_parallel_region,
                   gather_from_tensor_parallel_region, scatter_to_tensor_parallel_region)
from .plan import (ParallelStyle, Replicate, Shard, grad_reduced_upstream, install_shards, is_sequence_dim, layout_of,
                   set_forward)
from .sharded_ops import column_parallel_linear, row_parallel_linear, vocab_parallel_embedding
from .sharding import check_divisible, column_shards, is_conv1d, row_shards


class ColwiseParallel(ParallelStyle):
    """nn.Linear / Conv1D with the output features split (nn.Embedding: the embedding dim).

    input_layouts: Replicate() (default; the input grad is all-reduced here, overlapped with the
    weight-grad GEMM, unless a PrepareModuleInput sums it upstream) or Shard(seq_dim) (all-gathered
    here; its grad reduce-scattered). output_layouts: Shard(-1) (default, this rank's features)
    or Replicate() (all-gathered). num_fused: the output holds that many equal blocks, each
    split on its own (GPT-2's fused q|k|v). nn.Embedding: Shard(d) token ids are all-gathered
    along d first, as torch's. use_local_output: True only (torch's False returns a DTensor of the
    global shape; pynccl's outputs are plain local tensors), False raises ValueError.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 num_fused: int = 1):
        local_output_only("ColwiseParallel", use_local_output)
        self.input_layout = layout_of(input_layouts or Replicate(), "ColwiseParallel input_layouts")
        self.output_layout = layout_of(output_layouts or Shard(-1), "ColwiseParallel output_layouts")
        if self.output_layout.is_shard() and self.output_layout.dim != -1:
            raise ValueError(f"ColwiseParallel: output_layouts must be Shard(-1) or Replicate(), "
                             f"got {self.output_layout}")
        if num_fused > 1 and self.output_layout.is_replicate():
            raise ValueError(f"ColwiseParallel: a gathered fused output would interleave the blocks rank by rank; "
                             f"num_fused={num_fused} needs output_layouts=Shard(-1)")
        self.num_fused = num_fused

    def __repr__(self):
        return f"ColwiseParallel(input={self.input_layout}, output={self.output_layout}, num_fused={self.num_fused})"

    def check(self, module, name, tp_size):
        if isinstance(module, nn.Embedding):
            check_divisible(name, "embedding_dim", module.embedding_dim, tp_size)
        elif isinstance(module, nn.Linear):
            check_divisible(name, "out_features", module.out_features, tp_size, self.num_fused)
        elif is_conv1d(module):
            check_divisible(name, "out_features (nf)", module.nf, tp_size, self.num_fused)
        else:
            raise ValueError(f"{name}: ColwiseParallel supports nn.Linear, nn.Embedding and Conv1D, "
                             f"got {type(module).__name__}")

    def apply(self, module, name, group, sharded):
        conv1d = is_conv1d(module)
        install_shards(module, column_shards(module, group, self.num_fused, sharded))
        style, gather_output = self, self.output_layout.is_replicate()
        overlap_gemm = async_tp.enabled(sequence_parallel=self.input_layout.is_shard())

        def forward(mod, x):
            if isinstance(mod, nn.Embedding):
                x = _whole_token_ids(x, style.input_layout, group)
                y = F.embedding(x, mod.weight, mod.padding_idx, mod.max_norm, mod.norm_type, mod.scale_grad_by_freq,
                                mod.sparse)  # (b, s) -> (b, s, h/tp)
                return gather_from_tensor_parallel_region(y, group) if gather_output else y
            ready = async_tp.precomputed(x, mod)
            if ready is not None:            # the block's input gather computed it (async_tp.py)
                y = ready if mod.bias is None else ready + mod.bias.to(ready.dtype)  # F.linear's dtype
                return gather_from_tensor_parallel_region(y, group) if gather_output else y
            summed = grad_reduced_upstream(x, group)
            if summed and not style.input_layout.is_replicate():
                raise ValueError(f"ColwiseParallel(input_layouts={style.input_layout}): the input was made "
                                 f"Replicate() by a PrepareModuleInput; declare input_layouts=Replicate()")
            taken = grad_overlap.take_alias(x, mod) if summed else None
            if taken is not None:            # the weight gradient overlaps the input gradient's collective
                y = grad_overlap.linear(x, taken[0], mod.bias, taken[1], mod, transposed=conv1d)
                return gather_from_tensor_parallel_region(y, group) if gather_output else y
            # (b, s, in), or (b, s/tp, in) with a Shard(seq) input -> (b, s, out/tp), or (b, s, out) gathered
            return column_parallel_linear(x, mod.weight.t() if conv1d else mod.weight, mod.bias, group,
                                          sequence_parallel=style.input_layout.is_shard(), gather_output=gather_output,
                                          seq_dim=style.input_layout.dim if style.input_layout.is_shard() else 0,
                                          input_grad_summed=summed, overlap_gemm=overlap_gemm)

        set_forward(module, self, forward)


class RowwiseParallel(ParallelStyle):
    """nn.Linear / Conv1D with the input features split; the partial outputs are summed
    (output_layouts Replicate(): all-reduce, default; Shard(seq_dim): reduce-scatter along the
    sequence) and the bias added once, after the sum. input_layouts: Shard(-1) (default, the
    output of a ColwiseParallel layer) or Replicate() (sliced here); a Shard of another dim raises
    ValueError (torch re-lays it to the features with an all-to-all). output_layouts Shard(-1):
    the sum reduce-scattered over the features, this rank's slice of the bias added.
    nn.Embedding: the vocabulary is split (rows); each rank looks up its own token ids and the
    sum over ranks is the lookup (input_layouts Replicate() or None: the token ids; Shard(d),
    torch's default Shard(-1) among them: all-gathered along d first, as torch's).
    use_local_output: True only, as ColwiseParallel's."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        local_output_only("RowwiseParallel", use_local_output)
        self.input_layout = layout_of(input_layouts, "RowwiseParallel input_layouts", allow_none=True)
        self.output_layout = layout_of(output_layouts or Replicate(), "RowwiseParallel output_layouts")

    def __repr__(self):
        return f"RowwiseParallel(input={self.input_layout}, output={self.output_layout})"

    def check(self, module, name, tp_size):
        if isinstance(module, nn.Embedding):
            check_divisible(name, "num_embeddings", module.num_embeddings, tp_size,
                              hint=" (pad the vocabulary: model.resize_token_embeddings(n, pad_to_multiple_of=tp))")
            if module.max_norm is not None or module.sparse:
                raise ValueError(f"{name}: RowwiseParallel supports neither max_norm nor sparse embeddings")
        elif isinstance(module, nn.Linear):
            check_divisible(name, "in_features", module.in_features, tp_size)
        elif is_conv1d(module):
            check_divisible(name, "in_features (nx)", module.nx, tp_size)
        else:
            raise ValueError(f"{name}: RowwiseParallel supports nn.Linear, nn.Embedding and Conv1D, "
                             f"got {type(module).__name__}")

    def apply(self, module, name, group, sharded):
        conv1d, style = is_conv1d(module), self
        install_shards(module, row_shards(module, group, sharded))  # the bias stays whole
        # The sum over ranks: an all-reduce (Replicate()), or a reduce-scatter to Shard(seq_dim).
        sequence_parallel = self.output_layout.is_shard()
        seq_dim = self.output_layout.dim if sequence_parallel else 0
        overlap_gemm = async_tp.enabled(sequence_parallel)
        slices = async_tp_allreduce.chunks_requested() if overlap_gemm and not sequence_parallel else 0
        if isinstance(module, nn.Embedding):
            start = dist.get_rank(group) * (module.num_embeddings // dist.get_world_size(group))

            def forward(mod, tokens):  # (b, s) -> (b, s, h), or (b, s/tp, h)
                tokens = _whole_token_ids(tokens, style.input_layout, group)
                return vocab_parallel_embedding(tokens, mod.weight, start, group, mod.padding_idx, sequence_parallel,
                                                seq_dim)
        else:
            input_is_parallel = self.input_layout is None or not self.input_layout.is_replicate()

            def forward(mod, x):  # (.., in/tp), or (.., in) sliced here -> (.., out), or (b, s/tp, out)
                weight, bias = mod.weight.t() if conv1d else mod.weight, getattr(mod, "bias", None)
                if style.input_layout is not None and is_sequence_dim(style.input_layout, x.dim()):
                    raise ValueError(f"RowwiseParallel(input_layouts={style.input_layout}) on an input of shape "
                                     f"{tuple(x.shape)}: the input must be Shard(-1) (this rank's features) or "
                                     f"Replicate(); torch re-lays another dim's shard with an all-to-all, "
                                     f"pynccl does not")
                parallel = input_is_parallel
                if not parallel and grad_reduced_upstream(x, group):
                    # made Replicate() by a PrepareModuleInput, which sums x's gradient: this rank's slice by a
                    # narrow, whose gradient is zero outside the slice, so that sum makes it whole once
                    width = x.shape[-1] // dist.get_world_size(group)
                    x, parallel = x.narrow(-1, dist.get_rank(group) * width, width), True
                if sequence_parallel and not is_sequence_dim(style.output_layout, x.dim()):
                    # Shard(-1): the features reduce-scattered, this rank's slice of the bias (its grad all-gathered)
                    y = row_parallel_linear(x, weight, None, group, parallel, True, -1)
                    return y if bias is None else y + scatter_to_tensor_parallel_region(bias, group)
                return row_parallel_linear(x, weight, bias, group, parallel, sequence_parallel, seq_dim,
                                           overlap_gemm, slices)

        set_forward(module, self, forward)


def local_output_only(name: str, use_local_output: bool) -> None:
    """torch's use_local_output=False returns DTensors; pynccl has none: refused, naming the argument."""
    if not use_local_output:
        raise ValueError(f"{name}(use_local_output=False): torch returns a DTensor (of the global shape) there; "
                         f"pynccl has no DTensor and returns the local tensor, so use_local_output must be True")


def _whole_token_ids(tokens, layout, group):
    """An embedding's token ids made whole: Shard(d) ids all-gathered along d (torch's annotation then
    redistribution to Replicate()); Replicate() or None: as they are."""
    if layout is None or layout.is_replicate():
        return tokens
    return gather_from_sequence_parallel_region(tokens, group, grad_is_partial=False, seq_dim=layout.dim)


def _swap_in(places, tensors):
    """Make each (submodule, attr) read the given tensor; returns what to restore: (the dict the
    attribute is read from, attr, its old value). Where something shadows the Parameter in the
    module's __dict__ (what ZeRO installs) that entry is swapped, else the `_parameters` entry.
    NOTE: never adds or deletes a key, only replaces values: dynamo (torch 2.11) cannot trace a
    `del module.__dict__[attr]` (a graph break per call under torch.compile)."""
    saved = []
    for (sub, attr), t in zip(places, tensors):
        where = sub.__dict__ if attr in sub.__dict__ else sub._parameters
        saved.append((where, attr, where[attr]))
        where[attr] = t
    return saved


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
            saved = _swap_in(places, current)
            try:
                return inner(*args, **kwargs)
            finally:
                for where, attr, old in saved:
                    where[attr] = old

        set_forward(module, self, forward)


class AllPositionLogits(ParallelStyle):
    """A Hugging Face *ForCausalLM whose final hidden states reach its LM head as token shards
    (sequence parallelism, the head gathering them itself): its forward slices those states for
    `logits_to_keep` before the head, which would keep positions of this rank's shard, not of the
    sequence. A call asking for anything but every position (logits_to_keep other than 0) raises
    ValueError instead."""

    def __repr__(self):
        return "AllPositionLogits()"

    def apply(self, module, name, group, sharded):
        def hook(mod, args, kwargs):
            keep = kwargs.get("logits_to_keep", 0)
            if isinstance(keep, torch.Tensor) or keep != 0:
                shown = f"a tensor of shape {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else repr(keep)
                raise ValueError(f"{type(mod).__name__}: logits_to_keep={shown} under sequence parallelism: the "
                                 "model slices its final hidden states before the LM head, and they are this "
                                 "rank's token shard there. Call it with logits_to_keep=0 (every position) and "
                                 "slice the logits, or parallelize it without sequence parallelism")
        module.register_forward_pre_hook(hook, with_kwargs=True)


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
            check_divisible(name, attr, value, tp_size)
        for attr in self.attributes:
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                raise ValueError(f"{name}: LocalHeads needs an int attribute {attr!r}, got {value!r}")
            check_divisible(name, attr, value, tp_size)

    def apply(self, module, name, group, sharded):
        for attr in self.attributes:
            setattr(module, attr, getattr(module, attr) // dist.get_world_size(group))
