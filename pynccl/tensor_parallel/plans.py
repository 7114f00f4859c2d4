"""Ready tensor-parallel plans for Hugging Face models, for parallelize_module:

    model = parallelize_module(LlamaForCausalLM(config), tp_group, plans.llama(sequence_parallel=True))

Megatron's split (arXiv:1909.08053 §3): attention q/k/v and the MLP's gate/up by columns, o_proj
and down_proj by rows, so each block costs one all-reduce forward and one backward (one all-gather
+ one reduce-scatter each way with sequence parallelism, arXiv:2205.05198, as torchtitan's plan).
The embedding is split along the vocabulary, and the LM head too: with loss_parallel the loss is
vocab_parallel_cross_entropy on the logits' vocabulary slices (out.logits is this rank's slice);
without it the logits are all-gathered and the model's own loss runs.

Sequence parallelism and the embedding: Hugging Face models derive the position ids and the
attention mask from the embedding output's sequence length, so the embedding output stays whole
(an all-reduce instead of torchtitan's reduce-scatter) and the first decoder layer takes its
sequence shard (PrepareModuleInput Replicate() -> Shard(1), a slice). The cost is one extra
all-gather's worth of traffic per forward, for the whole model. Dropout on sharded activations
draws per-rank masks (use get_rng_tracker for reproducible ones); the tests run without dropout.

sequence_dim: which dim of the [b, s, h] activations a sequence-parallel region splits. 1, the
sequence (torchtitan's layout), is the default. 0 splits the batch instead: the norms and
residuals between the blocks are per token, so any split of the tokens computes the same values
(dropout draws its masks per rank either way), and a batch slab is contiguous, so each all-gather
writes the whole tensor in place and each reduce-scatter reads its input as it is (with dim 1 and
a batch above 1 every rank's chunk is strided: a relayout copy per collective, as Megatron avoids
by its [s, b, h] layout). The batch must divide by the TP size (else ValueError at the first
forward, naming the dim). With sequence parallelism the Llama plan refuses a partial
logits_to_keep (AllPositionLogits): the model would slice a token shard.
"""
from __future__ import annotations

from typing import Dict, Optional

from .loss_parallel import LossParallel
from .plan import ParallelStyle, Replicate, Shard
from .relayout import PrepareModuleInput, PrepareModuleOutput
from .styles import AllPositionLogits, ColwiseParallel, LocalHeads, RowwiseParallel, SequenceParallel

SEQUENCE_DIMS = (0, 1)  # of Hugging Face's [b, s, h]: the batch or the sequence (see the module docstring)


def _token_shard(sequence_parallel: bool, sequence_dim: int) -> Optional[Shard]:
    """The layout of the activations between the blocks: Shard(sequence_dim), or None without
    sequence parallelism (sequence_dim is checked either way: a typo is an error, not ignored)."""
    if type(sequence_dim) is not int or sequence_dim not in SEQUENCE_DIMS:
        raise ValueError(f"plans: sequence_dim must be 0 (the batch) or 1 (the sequence) of the [b, s, h] "
                         f"activations, got {sequence_dim!r}")
    return Shard(sequence_dim) if sequence_parallel else None


def _lm_head(seq, loss_parallel: bool) -> ColwiseParallel:
    """seq: the final norm's token shard (Shard), gathered here; None without sequence parallelism."""
    return ColwiseParallel(input_layouts=seq or Replicate(),
                           output_layouts=Shard(-1) if loss_parallel else Replicate())


def _block_input(seq, kwarg: str = "") -> PrepareModuleInput:
    """Make an attention / MLP block's input whole once, and sum its grad once for all its
    column-parallel projections (seq: the input's token shard, None without sequence parallelism;
    kwarg: the input's name when the caller passes it by keyword)."""
    src = seq or Replicate()
    if kwarg:
        return PrepareModuleInput(input_kwarg_layouts={kwarg: src}, desired_input_kwarg_layouts={kwarg: Replicate()})
    return PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(Replicate(),))


def llama(sequence_parallel: bool = False, loss_parallel: bool = True, sequence_dim: int = 1) -> Dict[str, object]:
    """Plan for LlamaForCausalLM (also Mistral / Qwen2-style models with the same module names).
    Grouped-query attention works when num_key_value_heads divides by the TP size (each rank
    keeps num_attention_heads/tp query heads and num_key_value_heads/tp key/value heads, the
    same ratio); else ValueError naming num_key_value_heads. Nothing in LlamaAttention's forward
    reads a global head count (transformers 5.17): q/k/v are viewed as (*input_shape, -1,
    head_dim), so the column-split projections give the local heads, and the eager / SDPA
    attention read only num_key_value_groups, the unchanged ratio. sequence_dim: see the module
    docstring."""
    seq = _token_shard(sequence_parallel, sequence_dim)
    out = seq or Replicate()
    layer = "model.layers.*"
    plan: Dict[str, object] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        f"{layer}.self_attn": (LocalHeads(config_attributes=("num_attention_heads", "num_key_value_heads")),
                               _block_input(seq, kwarg="hidden_states")),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=out),
        f"{layer}.mlp": _block_input(seq),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=out),
        "lm_head": _lm_head(seq, loss_parallel),
    }
    if seq is not None:
        plan.update({
            "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,)),
            f"{layer}.input_layernorm": SequenceParallel(sequence_dim=sequence_dim),
            f"{layer}.post_attention_layernorm": SequenceParallel(sequence_dim=sequence_dim),
            "model.norm": SequenceParallel(sequence_dim=sequence_dim),
        })
    # NOTE: with sequence parallelism the model slices its final norm's token shard for logits_to_keep
    # before lm_head gathers it: AllPositionLogits refuses a partial one (GPT-2's gathers at ln_f).
    root = ((LossParallel(),) if loss_parallel else ()) + ((AllPositionLogits(),) if seq is not None else ())
    if root:
        plan[""] = root if len(root) > 1 else root[0]
    return plan


def gpt2(sequence_parallel: bool = False, loss_parallel: bool = True, sequence_dim: int = 1) -> Dict[str, object]:
    """Plan for GPT2LMHeadModel. Its Conv1D layers store weights transposed, (in, out): c_attn
    and c_fc are split along their output dim 1, with c_attn's q|k|v blocks each split on their
    own (num_fused=3: rank r keeps q_r|k_r|v_r); c_proj along its input dim 0. The attention's
    split_size, num_heads and embed_dim become per-rank values. wte and the tied lm_head share
    one vocabulary-split weight. sequence_dim: see the module docstring."""
    seq = _token_shard(sequence_parallel, sequence_dim)
    out = seq or Replicate()
    block = "transformer.h.*"
    plan: Dict[str, object] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        f"{block}.attn": (LocalHeads(attributes=("num_heads", "split_size", "embed_dim")),
                          _block_input(seq)),
        f"{block}.attn.c_attn": ColwiseParallel(num_fused=3),
        f"{block}.attn.c_proj": RowwiseParallel(output_layouts=out),
        f"{block}.mlp": _block_input(seq),
        f"{block}.mlp.c_fc": ColwiseParallel(),
        f"{block}.mlp.c_proj": RowwiseParallel(output_layouts=out),
        "lm_head": _lm_head(None, loss_parallel),
    }
    if seq is not None:
        plan.update({
            "transformer.h.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,)),
            f"{block}.ln_1": SequenceParallel(sequence_dim=sequence_dim),
            f"{block}.ln_2": SequenceParallel(sequence_dim=sequence_dim),
            # GPT2Model views its output to the input's sequence length: gather it first.
            "transformer.ln_f": (SequenceParallel(sequence_dim=sequence_dim), PrepareModuleOutput(output_layouts=seq,
                                                                         desired_output_layouts=Replicate())),
        })
    if loss_parallel:
        plan[""] = LossParallel()
    return plan


__all__ = ["llama", "gpt2", "ParallelStyle"]
