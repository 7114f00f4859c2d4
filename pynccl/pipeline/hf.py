"""Pipeline stages cut from a Hugging Face causal LM (LlamaForCausalLM and its kin, GPT2LMHeadModel),
so an unmodified HF model trains under pynccl.pipeline (or torch.distributed.pipelining):

    stages = hf_stage_modules(model, pp_rank, pp_size)          # stage pp_rank, or v stages when interleaved
    stage = PipelineStage(stages[0], pp_rank, pp_size, group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=causal_lm_loss)
    schedule.step(input_ids)                                    # first stage
    schedule.step(target=input_ids, losses=losses)              # last stage: labels = input ids, as HF

The decoder layers (model.model.layers / model.transformer.h) are cut into contiguous ranges;
the first stage also holds the embeddings, the last the final norm and the LM head. Each stage
calls its layers exactly as the HF model's forward does; what the HF model computes once before
its layers (position ids, the causal mask, Llama's rotary cos/sin) depends on the sequence length
only, so every stage recomputes it instead of receiving it: one tensor (the hidden states) travels
between stages. Stage modules hold the model's own submodules (no copies), so
model.named_parameters() names a stage's parameters and model.state_dict() after training is the
HF checkpoint (each rank's stages' entries). transformers is imported only when a stage runs.
"""
from __future__ import annotations

import functools
import inspect
from typing import List, Optional, Sequence

import torch
from torch import nn

from .split import split_into_stages


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF's causal-LM loss (ForCausalLMLoss) as a schedule loss_fn: token t predicts label t + 1,
    the last position has no label; mean over the labelled tokens, computed in fp32.
    NOTE: each micro-batch's mean, averaged by the schedule, equals the whole batch's mean only when
    every micro-batch holds as many labelled tokens (no padding), as in pretraining."""
    # labels (b, s) -> (b, s) shifted left, -100 at the end; logits (b, s, V) -> (b·s, V)
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(), ignore_index=ignore_index)


def _positions(x: torch.Tensor) -> torch.Tensor:
    # (1, s): what the HF model uses when called without position_ids and without a cache.
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _causal_mask(config, hidden: torch.Tensor, position_ids: torch.Tensor):
    """The mask HF's forward builds for a batch without padding (None where the attention kernel
    applies causality itself, e.g. SDPA's is_causal)."""
    from transformers.masking_utils import create_causal_mask
    # The no-cache argument is `cache` from transformers 5.2x on, `past_key_values` before (deprecated since).
    no_cache = {"cache" if "cache" in _parameters(create_causal_mask) else "past_key_values": None}
    return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, position_ids=position_ids,
                              **no_cache)


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


class _CausalLMStage(nn.Module):
    """forward(x): x is (b, s) token ids on the first stage, (b, s, h) hidden states elsewhere;
    returns (b, s, h) hidden states, or (b, s, vocab) logits on the last stage."""

    def __init__(self, config, layers: Sequence[nn.Module], is_first: bool, is_last: bool, layer_range):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)
        self.is_first, self.is_last = is_first, is_last
        self.layer_range = layer_range          # (start, end) in the model's layer list

    def extra_repr(self) -> str:
        start, end = self.layer_range
        return f"layers [{start}, {end}), first={self.is_first}, last={self.is_last}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first and x.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{type(self).__name__}: the first stage takes token ids (int64), got {x.dtype}")
        position_ids = _positions(x)
        hidden = self.embed(x, position_ids) if self.is_first else x
        mask = _causal_mask(self.config, hidden, position_ids)
        hidden = self.run_layers(hidden, mask, position_ids)
        return self.head(hidden) if self.is_last else hidden


class LlamaStage(_CausalLMStage):
    """A range of a Llama-style model's decoder layers (LlamaForCausalLM, Mistral, Qwen2: model.model
    holds embed_tokens, rotary_emb, layers, norm; model.lm_head the head)."""

    def __init__(self, model: nn.Module, start: int, end: int, is_first: bool, is_last: bool):
        base = model.model
        super().__init__(model.config, list(base.layers)[start:end], is_first, is_last, (start, end))
        # Parameter-free (inv_freq buffer only): every stage holds it and computes cos/sin itself.
        self.rotary_emb = base.rotary_emb
        if is_first:
            self.embed_tokens = base.embed_tokens
        if is_last:
            self.norm, self.lm_head = base.norm, model.lm_head

    def embed(self, input_ids, position_ids):
        return self.embed_tokens(input_ids)

    def run_layers(self, hidden, mask, position_ids):
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids)
        return hidden

    def head(self, hidden):
        return self.lm_head(self.norm(hidden))


class GPT2Stage(_CausalLMStage):
    """A range of GPT2LMHeadModel's blocks (model.transformer holds wte, wpe, drop, h, ln_f)."""

    def __init__(self, model: nn.Module, start: int, end: int, is_first: bool, is_last: bool):
        base = model.transformer
        super().__init__(model.config, list(base.h)[start:end], is_first, is_last, (start, end))
        if is_first:
            self.wte, self.wpe, self.drop = base.wte, base.wpe, base.drop
        if is_last:
            self.ln_f, self.lm_head = base.ln_f, model.lm_head

    def embed(self, input_ids, position_ids):
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))

    def run_layers(self, hidden, mask, position_ids):
        for block in self.layers:
            hidden = block(hidden, attention_mask=mask, position_ids=position_ids)
        return hidden

    def head(self, hidden):
        return self.lm_head(self.ln_f(hidden))


def _family(model: nn.Module):
    """(stage class, the model's decoder layer list)."""
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")) \
            and hasattr(model, "lm_head"):
        return LlamaStage, base.layers
    base = getattr(model, "transformer", None)
    if base is not None and all(hasattr(base, a) for a in ("wte", "wpe", "h", "ln_f")) and hasattr(model, "lm_head"):
        return GPT2Stage, base.h
    raise TypeError(f"hf_stage_module: expected a Hugging Face causal LM with Llama's layout (model.model."
                    f"{{embed_tokens, rotary_emb, layers, norm}}, model.lm_head) or GPT-2's (model.transformer."
                    f"{{wte, wpe, h, ln_f}}, model.lm_head), got {type(model).__name__}")


def _check_untied(model: nn.Module, num_stages: int) -> None:
    """Tied input/output embeddings cannot live on two stages: each would train its own copy."""
    if num_stages == 1:
        return
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        raise ValueError(f"hf_stage_module: {type(model).__name__} ties its LM head to the input embedding "
                         f"(config.tie_word_embeddings=True), which would sit on the first and the last of "
                         f"{num_stages} stages; build the model with tie_word_embeddings=False to pipeline it")


def hf_layer_ranges(model: nn.Module, num_stages: int, boundaries: Optional[Sequence[int]] = None):
    """[(start, end)] decoder-layer ranges of each stage: balanced by parameter count (identical
    decoder layers: as even as the count allows), or at `boundaries` (first layer of stages 1..)."""
    _, layers = _family(model)
    return split_into_stages(list(layers), num_stages, boundaries)


def hf_stage_module(model: nn.Module, stage_index: int, num_stages: int,
                    boundaries: Optional[Sequence[int]] = None) -> nn.Module:
    """Stage `stage_index` of `num_stages` of an HF causal LM (see the module docstring); the
    model's submodules, not copies. Move it to its device with .to() as any module."""
    cls, _ = _family(model)
    if not isinstance(stage_index, int) or isinstance(stage_index, bool) or not 0 <= stage_index < num_stages:
        raise ValueError(f"hf_stage_module: stage_index must be in [0, num_stages={num_stages}), got {stage_index!r}")
    _check_untied(model, num_stages)
    start, end = hf_layer_ranges(model, num_stages, boundaries)[stage_index]
    return cls(model, start, end, stage_index == 0, stage_index == num_stages - 1)


def hf_stage_modules(model: nn.Module, pp_rank: int, pp_size: int, stages_per_rank: int = 1,
                     boundaries: Optional[Sequence[int]] = None) -> List[nn.Module]:
    """The stages of pp rank `pp_rank`: stage k of pp_size × stages_per_rank runs on rank
    k % pp_size (pynccl.pipeline's and torch.distributed.pipelining's interleaved placement), so
    rank r holds stages r, r + pp_size, ...; one stage when stages_per_rank is 1."""
    for name, value in (("pp_size", pp_size), ("stages_per_rank", stages_per_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"hf_stage_modules: {name} must be a positive int, got {value!r}")
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"hf_stage_modules: pp_rank must be in [0, pp_size={pp_size}), got {pp_rank!r}")
    num_stages = pp_size * stages_per_rank
    return [hf_stage_module(model, k, num_stages, boundaries) for k in range(pp_rank, num_stages, pp_size)]
