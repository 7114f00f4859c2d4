"""Tensor parallelism with optional sequence parallelism (Megatron-style): sharded layers, the
autograd communication ops they are made of, vocabulary-parallel cross-entropy, the RNG
tracker for dropout, and a GPT-2-style block built from them.

Layout [s, b, h] (sequence first). `group` is the TP ProcessGroup (None: the default group).
With sequence_parallel=True, activations between blocks are this rank's (s/tp, b, h) shard;
the grads of replicated parameters used on shards (LayerNorms, row-parallel biases) are summed
over the TP group automatically, inside autograd.
"""
from .comm import (allreduce_grads_in_backward, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                   gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                   reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                   scatter_to_tensor_parallel_region)
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (ColumnParallelLinear, ParallelLayerNorm, RowParallelLinear, VocabParallelEmbedding,
                     column_parallel_linear, shard_like, shard_tensor)
from .random import (MODEL_PARALLEL_RNG, RNGStatesTracker, get_cuda_rng_tracker, get_rng_tracker,
                     model_parallel_seed)
from .reference import MLP, CausalSelfAttention, TransformerBlock
from .transformer import ParallelCausalSelfAttention, ParallelMLP, ParallelTransformerBlock

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLayerNorm",
    "ParallelMLP", "ParallelCausalSelfAttention", "ParallelTransformerBlock",
    "MLP", "CausalSelfAttention", "TransformerBlock",
    "vocab_parallel_cross_entropy", "column_parallel_linear", "shard_tensor", "shard_like",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "allreduce_grads_in_backward",
    "RNGStatesTracker", "get_rng_tracker", "get_cuda_rng_tracker", "model_parallel_seed", "MODEL_PARALLEL_RNG",
]
