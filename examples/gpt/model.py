"""A small GPT (pre-LN, learned positions, untied LM head) built as one pipeline stage of a mesh.

    stage = GPTStage(config, mesh, sequence_parallel=True)   # this rank's layers, TP-sharded

Every rank builds only its pipeline stage: the embedding on the first, blocks
[pp_rank·L/pp, (pp_rank+1)·L/pp), the final LayerNorm and LM head on the last. Blocks are
tensor parallel inside (pynccl.tensor_parallel). Parameter names are those of the
single-process model whatever the layout ("blocks.5.attn.qkv.weight" is block 5 on any stage),
so checkpoints are keyed the same way under every layout.

Initialisation is a function of (seed, layer) only: each part is built after seeding the
default generator with its own seed, and TP layers draw the unsharded weights and keep their
slice, so any mesh starts from exactly the single-process model's weights.
Layout [s, b, h] inside (sequence first, as pynccl.tensor_parallel); tokens enter as (b, s).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from pynccl.tensor_parallel import (ColumnParallelLinear, ParallelLayerNorm, ParallelTransformerBlock,
                                    VocabParallelEmbedding, allreduce_grads_in_backward, get_rng_tracker,
                                    vocab_parallel_cross_entropy)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int                 # real vocabulary (characters of the text)
    seq_len: int = 64
    num_layers: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    dropout: float = 0.0
    vocab_multiple: int = 64        # the embedding and head hold a vocabulary padded to a multiple of this

    @property
    def padded_vocab_size(self) -> int:
        """Same at every TP size (so are the checkpoint's shapes); the padded logits are masked out."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def to_dict(self) -> dict:
        return asdict(self)


def check_fits(config: GPTConfig, mesh, batch_size: int, micro_batches: int, sequence_parallel: bool) -> None:
    """One ValueError naming every dimension the mesh cannot split (heads, hidden and vocabulary by
    tp, layers by pp, the global batch by dp × micro-batches, the sequence by tp under SP)."""
    dims = dict(num_heads=config.num_heads, hidden_size=config.hidden_size,
                padded_vocab_size=config.padded_vocab_size, num_layers=config.num_layers)
    if sequence_parallel:
        dims["seq_len"] = config.seq_len
    problems = []
    try:
        mesh.check_divides(**dims)
    except ValueError as e:
        problems.append(str(e))
    if batch_size % (mesh.dp_size * micro_batches):
        problems.append(f"batch_size={batch_size} is not divisible by dp({mesh.dp_size}) × "
                        f"micro_batches({micro_batches}) = {mesh.dp_size * micro_batches}")
    if config.hidden_size % config.num_heads:
        problems.append(f"hidden_size={config.hidden_size} is not divisible by num_heads={config.num_heads}")
    if problems:
        raise ValueError("GPT does not fit the mesh: " + "; ".join(problems))


def _seeded(seed: int, part: int):
    """Build one part of the model from its own seed: same weights whatever else a rank builds."""
    torch.manual_seed(seed * 7919 + part)


class Embedding(nn.Module):
    """Token (vocabulary-parallel) plus position embeddings: (b, s) ids -> (s, b, h), or this rank's
    sequence shard (s/tp, b, h) with sequence parallelism."""

    def __init__(self, config: GPTConfig, tp_group, sequence_parallel: bool):
        super().__init__()
        self.tok = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, group=tp_group,
                                          sequence_parallel=sequence_parallel)
        self.pos = nn.Embedding(config.seq_len, config.hidden_size)   # replicated over TP
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.dropout = config.dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens.t())                    # (b, s) -> (s, b) -> (s, b, h) or (s/tp, b, h)
        pos = self.pos.weight[: tokens.shape[1]]    # (s, h)
        if self.sequence_parallel:
            # Each rank adds only its slab of positions: the grad is a partial sum over TP ranks.
            pos, = allreduce_grads_in_backward((pos,), self.tp_group)
            n = x.shape[0]
            pos = pos[self.tp_group.group_rank * n: (self.tp_group.group_rank + 1) * n]   # (s/tp, h)
        x = x + pos.unsqueeze(1)
        if self.dropout and self.training:
            with get_rng_tracker().fork(device=x.device) if self.sequence_parallel else contextlib.nullcontext():
                x = nn.functional.dropout(x, self.dropout, True)
        return x


class Head(nn.Module):
    """Final LayerNorm and the LM head: (s, b, h) (or (s/tp, b, h)) -> logits (s, b, V_padded/tp)."""

    def __init__(self, config: GPTConfig, tp_group, sequence_parallel: bool):
        super().__init__()
        self.ln_f = ParallelLayerNorm(config.hidden_size, group=tp_group, sequence_parallel=sequence_parallel)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.padded_vocab_size, bias=False,
                                            group=tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))           # (s, b, h) -> (s, b, V_padded/tp)


def _tracker_contexts():
    """torch.utils.checkpoint restores the default generators for recomputation; these restore the
    TP tracker's states too, so recomputed dropout on sharded activations draws the same masks."""
    tracker, saved = get_rng_tracker(), {}

    @contextlib.contextmanager
    def forward():
        saved["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(saved["states"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return forward(), recompute()


class GPTStage(nn.Module):
    """This rank's pipeline stage of the GPT. First stage: (b, s) token ids in; last stage: logits
    (s, b, V_padded/tp) out; in between (and between stages): hidden states (s or s/tp, b, h)."""

    def __init__(self, config: GPTConfig, mesh, sequence_parallel: bool = False,
                 activation_checkpointing: bool = False, seed: int = 0):
        super().__init__()
        layers_per_stage = config.num_layers // mesh.pp_size
        self.first_layer = mesh.pp_rank * layers_per_stage
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        tp_group = mesh.tp_group
        self.embed = self.head = None
        if mesh.is_first_stage:
            _seeded(seed, 0)
            self.embed = Embedding(config, tp_group, sequence_parallel)
        # A ModuleDict keyed by the global block index: names match the single-process model's.
        self.blocks = nn.ModuleDict()
        for i in range(self.first_layer, self.first_layer + layers_per_stage):
            _seeded(seed, 1 + i)
            self.blocks[str(i)] = ParallelTransformerBlock(
                config.hidden_size, config.num_heads, dropout=config.dropout, attn_dropout=config.dropout,
                group=tp_group, sequence_parallel=sequence_parallel)
        if mesh.is_last_stage:
            _seeded(seed, 1 + config.num_layers)
            self.head = Head(config, tp_group, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)                       # (b, s) ids -> (s, b, h)
        for block in self.blocks.values():
            if self.activation_checkpointing and self.training:
                # Keep only the block's input; recompute its inside (and its TP collectives) in backward.
                # NOTE: early stop (torch's default, pinned here) ends the recomputation once backward
                # has the tensors it needs, before the block's forward hooks: ZeRO-3's post-forward
                # hook would otherwise release the parameters the recomputed graph just saved.
                with set_checkpoint_early_stop(True):
                    x = checkpoint(block, x, use_reentrant=False, context_fn=_tracker_contexts)
            else:
                x = block(x)
        if self.head is not None:
            x = self.head(x)                        # -> (s, b, V_padded/tp)
        return x


def tp_shard_spec(module: nn.Module) -> Dict[str, Tuple[Optional[int], int]]:
    """name -> (tp_shard_dim or None when replicated over TP, number of fused blocks), for every
    parameter, read before any wrapper takes the parameters over."""
    return {name: (getattr(p, "tp_shard_dim", None), getattr(p, "tp_num_chunks", 1))
            for name, p in module.named_parameters()}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, tp_group, vocab_size: int) -> torch.Tensor:
    """Mean next-token cross-entropy from this rank's vocabulary slice: logits (s, b, V_padded/tp),
    targets (b, s). The padded vocabulary (ids >= vocab_size) is masked out."""
    return vocab_parallel_cross_entropy(logits, targets.t(), group=tp_group, vocab_size=vocab_size)
