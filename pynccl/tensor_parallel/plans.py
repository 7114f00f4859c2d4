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
"""
from __future__ import annotations

from typing import Dict

from .loss_parallel import LossParallel
from .plan import ParallelStyle, Replicate, Shard
from .relayout import PrepareModuleInput, PrepareModuleOutput
from .styles import ColwiseParallel, LocalHeads, RowwiseParallel, SequenceParallel

SEQ = Shard(1)  # the sequence of Hugging Face's [b, s, h]


def _lm_head(sequence_parallel: bool, loss_parallel: bool) -> ColwiseParallel:
    """sequence_parallel: its input is the final norm's sequence shard, gathered here."""
    return ColwiseParallel(input_layouts=SEQ if sequence_parallel else Replicate(),
                           output_layouts=Shard(-1) if loss_parallel else Replicate())


def _block_input(sequence_parallel: bool, kwarg: str = "") -> PrepareModuleInput:
    """Make an attention / MLP block's input whole once, and sum its grad once for all its
    column-parallel projections (kwarg: the input's name when the caller passes it by keyword)."""
    src = SEQ if sequence_parallel else Replicate()
    if kwarg:
        return PrepareModuleInput(input_kwarg_layouts={kwarg: src}, desired_input_kwarg_layouts={kwarg: Replicate()})
    return PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(Replicate(),))


def llama(sequence_parallel: bool = False, loss_parallel: bool = True) -> Dict[str, object]:
    """Plan for LlamaForCausalLM (also Mistral / Qwen2-style models with the same module names).
    Grouped-query attention works when num_key_value_heads divides by the TP size (each rank
    keeps num_attention_heads/tp query heads and num_key_value_heads/tp key/value heads, the
    same ratio); else ValueError naming num_key_value_heads. Nothing in LlamaAttention's forward
    reads a global head count (transformers 5.17): q/k/v are viewed as (*input_shape, -1,
    head_dim), so the column-split projections give the local heads, and the eager / SDPA
    attention read only num_key_value_groups, the unchanged ratio."""
    out = SEQ if sequence_parallel else Replicate()
    layer = "model.layers.*"
    plan: Dict[str, object] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        f"{layer}.self_attn": (LocalHeads(config_attributes=("num_attention_heads", "num_key_value_heads")),
                               _block_input(sequence_parallel, kwarg="hidden_states")),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=out),
        f"{layer}.mlp": _block_input(sequence_parallel),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=out),
        "lm_head": _lm_head(sequence_parallel, loss_parallel),
    }
    if sequence_parallel:
        plan.update({
            "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(SEQ,)),
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            "model.norm": SequenceParallel(),
        })
    if loss_parallel:
        plan[""] = LossParallel()
    return plan


def gpt2(sequence_parallel: bool = False, loss_parallel: bool = True) -> Dict[str, object]:
    """Plan for GPT2LMHeadModel. Its Conv1D layers store weights transposed, (in, out): c_attn
    and c_fc are split along their output dim 1, with c_attn's q|k|v blocks each split on their
    own (num_fused=3: rank r keeps q_r|k_r|v_r); c_proj along its input dim 0. The attention's
    split_size, num_heads and embed_dim become per-rank values. wte and the tied lm_head share
    one vocabulary-split weight."""
    out = SEQ if sequence_parallel else Replicate()
    block = "transformer.h.*"
    plan: Dict[str, object] = {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        f"{block}.attn": (LocalHeads(attributes=("num_heads", "split_size", "embed_dim")),
                          _block_input(sequence_parallel)),
        f"{block}.attn.c_attn": ColwiseParallel(num_fused=3),
        f"{block}.attn.c_proj": RowwiseParallel(output_layouts=out),
        f"{block}.mlp": _block_input(sequence_parallel),
        f"{block}.mlp.c_fc": ColwiseParallel(),
        f"{block}.mlp.c_proj": RowwiseParallel(output_layouts=out),
        "lm_head": _lm_head(False, loss_parallel),
    }
    if sequence_parallel:
        plan.update({
            "transformer.h.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(SEQ,)),
            f"{block}.ln_1": SequenceParallel(),
            f"{block}.ln_2": SequenceParallel(),
            # GPT2Model views its output to the input's sequence length: gather it first.
            "transformer.ln_f": (SequenceParallel(), PrepareModuleOutput(output_layouts=SEQ,
                                                                         desired_output_layouts=Replicate())),
        })
    if loss_parallel:
        plan[""] = LossParallel()
    return plan


__all__ = ["llama", "gpt2", "ParallelStyle"]
