"""The vocabulary-parallel loss for Hugging Face causal LMs: LossParallel sets the model's
loss_function (a documented, settable attribute of PreTrainedModel) to Hugging Face's
ForCausalLMLoss computed with vocab_parallel_cross_entropy, so the logits, split along the
vocabulary by a ColwiseParallel LM head, are never gathered. The model's forward is unchanged.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..comm import distributed as dist
from .cross_entropy import vocab_parallel_cross_entropy
from .plan import STYLE_ATTR, ParallelStyle
from .styles import ColwiseParallel


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
        num_items = num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        loss = loss / num_items
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
        head_style = getattr(head, STYLE_ATTR, None)
        if not (isinstance(head_style, ColwiseParallel) and head_style.output_layout.is_shard()):
            raise ValueError(f"LossParallel: the LM head must be ColwiseParallel(output_layouts=Shard(-1)), "
                             f"found {head_style!r} on {type(head).__name__}")
        module.loss_function = functools.partial(vocab_parallel_causal_lm_loss, group=group)
