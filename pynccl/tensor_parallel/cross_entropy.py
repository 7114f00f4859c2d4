"""Cross-entropy over logits split along the vocabulary, never gathering them (Megatron,
arXiv:1909.08053 §3): each rank reduces its slice to a max, a sum of exps and the target's
logit, and only those (a few numbers per token) cross the group: one MAX all-reduce and one
SUM all-reduce carrying both sums. The math runs in fp32 whatever the logits' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import distributed as dist
from ..comm import functional_collectives as fc

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, vocab_size):
        tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
        vocab_per_rank = logits.shape[-1]
        vocab_start = tp_rank * vocab_per_rank
        input_dtype = logits.dtype
        num_padded = 0 if vocab_size is None else min(max(vocab_start + vocab_per_rank - vocab_size, 0),
                                                       vocab_per_rank)
        logits = logits.to(torch.float32, copy=num_padded > 0)  # copy only when the padding is written
        if num_padded:
            # Padded vocabulary columns: exp(-inf) = 0, so they drop out of every sum. A rank holding
            # only padding has a local max of -inf; the all-reduced max is still finite.
            logits[..., vocab_per_rank - num_padded:] = float("-inf")
        logits_max = logits.amax(dim=-1)  # (N,)
        if tp_size > 1:
            logits_max = fc.all_reduce(logits_max, group, "max")
        shifted = logits - logits_max.unsqueeze(-1)  # (N, V/tp), new buffer: the input stays intact

        in_range = (target >= vocab_start) & (target < vocab_start + vocab_per_rank)  # (N,)
        local_target = (target - vocab_start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp_()
        stats = torch.stack([target_logit, exp.sum(dim=-1)])  # (2, N): one collective for both sums
        if tp_size > 1:
            stats = fc.all_reduce(stats, group)
        target_logit, sum_exp = stats[0], stats[1]

        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, V/tp)
        ctx.save_for_backward(softmax, local_target, in_range & ~ignored, ignored)
        ctx.input_dtype = input_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, hit, ignored = ctx.saved_tensors
        # d loss_i / d z_ij = softmax_ij - [j == target_i]; zero for ignored tokens.
        scale = grad_loss.float().masked_fill(ignored, 0.0)  # (N,)
        grad = softmax * scale.unsqueeze(-1)  # out of place: a retained graph may run backward again
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-scale * hit).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group=None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 vocab_size: Optional[int] = None) -> torch.Tensor:
    """F.cross_entropy(full_logits, target) from this rank's vocabulary slice.

    logits_shard: (..., V/tp), rank r holding vocabulary entries [r*V/tp, (r+1)*V/tp) (as
    VocabParallelEmbedding.lm_logits and ColumnParallelLinear produce them); target: (...)
    global token ids, the same on every rank. vocab_size: the real vocabulary when the logits
    cover a padded one; logits of ids >= vocab_size are masked out (-inf). reduction and
    ignore_index as in F.cross_entropy (mean over the tokens not ignored). The loss is fp32.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not logits_shard.is_floating_point():
        raise TypeError(f"vocab_parallel_cross_entropy: logits must be floating point, got {logits_shard.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"vocab_parallel_cross_entropy: target must hold integer class ids, got {target.dtype}")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits_shard {tuple(logits_shard.shape)} must be "
                         f"target's shape {tuple(target.shape)} plus a vocabulary dim")
    tp_size = dist.get_world_size(group)
    if vocab_size is not None and not 0 < vocab_size <= tp_size * logits_shard.shape[-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size ({vocab_size}) must be in "
                         f"(0, tp_size({tp_size}) × logits_shard.shape[-1]({logits_shard.shape[-1]})]")
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target.long(), group, ignore_index, vocab_size)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
