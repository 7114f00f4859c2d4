"""Tensor parallelism with optional sequence parallelism, Megatron-style (arXiv:1909.08053,
arXiv:2205.05198). One set of building blocks: the autograd communication ops (comm.py), how a
parameter is cut (sharding.py) and the forward of a sharded layer (sharded_ops.py), each taking
the activation layout (where the sequence is) as an argument. Two ways to use them:
* modules written tensor-parallel: the sharded layers (layers.py, Megatron's [s, b, h] by
  default), a GPT-2-style block (transformer.py), vocabulary-parallel cross-entropy, the RNG
  tracker for dropout;
* by plan on an unmodified model (plan.py, styles.py, relayout.py, loss_parallel.py, plans.py:
  parallelize_module with ColwiseParallel, RowwiseParallel, SequenceParallel, ... as
  torch.distributed.tensor.parallel, Hugging Face's [b, s, h]), and a full state dict back from
  it (state_dict.py), or sharded as DTensors for torch.distributed.checkpoint (dcp.py).

Conventions
* Layout: the layers default to [s, b, h], sequence first (as Megatron): sequence parallelism
  splits dim 0, so each rank's shard is one contiguous slab and the all-gather / reduce-scatter
  need no transposes (`sequence_dim=1` for [b, s, h], which costs a copy each way). The GPT
  block and the unsharded reference modules (pynccl.testing.reference_models) are [s, b, h]; the
  plan's styles take the sequence dim from their layouts (Shard(1) for Hugging Face's [b, s, h];
  plans.llama / plans.gpt2 with sequence_dim=0 split the batch instead: contiguous slabs again).
* `group` is the TP ProcessGroup (pynccl.new_group / ParallelMesh), None for the default group.
  At TP size 1 no collective runs and the layers do what the unsharded ones do.
* Sizes: out_features (column), in_features (row), ffn_hidden_size and num_heads must divide by
  the TP size, else ValueError naming the dimension and the size. The vocabulary need not:
  VocabParallelEmbedding pads it to a multiple of the TP size with zero rows, and
  vocab_parallel_cross_entropy(..., vocab_size=V) masks the padded logits to -inf.
* sequence_parallel=True: activations between sublayers are this rank's (s/tp, b, h) shard
  (scatter_to_sequence_parallel_region, or VocabParallelEmbedding(sequence_parallel=True),
  enters; column layers all-gather, row layers reduce-scatter). Replicated parameters applied
  to shards (ParallelLayerNorm, the row-parallel bias) have their grads summed over the TP group
  automatically, inside autograd (allreduce_grads_in_backward: one collective per module), so
  grads are right under accumulation, DDP and ZeRO with nothing to call.
* Initialisation: a layer built from sizes draws the unsharded torch layer's weights from the
  default generator and keeps its slice, so the same seed gives the same model at any TP size
  (and the unsharded module, sharded); `from_linear` / `from_embedding` / `from_module` slice
  an existing module. Sharded params carry `tp_shard_dim`; see shard_like.
* Dropout: call model_parallel_seed(seed, tp_rank) on every rank. Default generators get `seed`
  (same masks on replicated activations across the TP group); the tracker's
  "model-parallel-rng" state gets seed + 2718 + tp_rank and serves sharded activations
  (attention heads, sequence-parallel shards), on CPU and CUDA alike.
"""
from .comm import (allreduce_grads_in_backward, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                   gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                   reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                   scatter_to_tensor_parallel_region)
from .._lazy import lazy_exports
from . import plans
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, ParallelLayerNorm, RowParallelLinear, VocabParallelEmbedding
from .sharded_ops import column_parallel_linear, row_parallel_linear, vocab_parallel_embedding
from .sharding import shard_like, shard_tensor
from .loss_parallel import LossParallel, vocab_parallel_causal_lm_loss
from .parallelize import parallelize_module
from .plan import ParallelStyle, Replicate, Shard, shard_specs
from .relayout import PrepareModuleInput, PrepareModuleOutput
from .styles import AllPositionLogits, ColwiseParallel, LocalHeads, RowwiseParallel, SequenceParallel
from .random import (MODEL_PARALLEL_RNG, RNGStatesTracker, get_cuda_rng_tracker, get_rng_tracker,
                     model_parallel_seed)
from .state_dict import unshard_tensor, unsharded_state_dict
from .transformer import ParallelCausalSelfAttention, ParallelMLP, ParallelTransformerBlock

# dcp.py needs torch.distributed.checkpoint and DTensor (seconds to import): loaded on first use.
_DCP_NAMES = ("sharded_state_dict", "load_sharded_state_dict", "sharded_optim_state_dict",
              "load_sharded_optim_state_dict")

__getattr__, __dir__ = lazy_exports(__name__, "dcp", _DCP_NAMES, globals())

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLayerNorm",
    "ParallelMLP", "ParallelCausalSelfAttention", "ParallelTransformerBlock",
    "vocab_parallel_cross_entropy", "column_parallel_linear", "row_parallel_linear", "vocab_parallel_embedding",
    "shard_tensor", "shard_like",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "allreduce_grads_in_backward",
    "RNGStatesTracker", "get_rng_tracker", "get_cuda_rng_tracker", "model_parallel_seed", "MODEL_PARALLEL_RNG",
    "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "LocalHeads", "LossParallel", "AllPositionLogits", "Shard",
    "Replicate", "plans",
    "shard_specs", "vocab_parallel_causal_lm_loss", "unsharded_state_dict", "unshard_tensor",
    "sharded_state_dict", "load_sharded_state_dict", "sharded_optim_state_dict", "load_sharded_optim_state_dict",
]
