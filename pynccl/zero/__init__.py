"""ZeRO stages 1-3 (optimizer state, gradients, parameters sharded) for a plain torch
optimizer and an ordinary training loop. See fsdp.py for the user-facing contract.

Files, one responsibility each:
  layout.py          flat shard layout (pure index arithmetic)
  flat_unit.py       a unit's master shard + full buffer; gather / free / reduce-scatter
  params.py          the wrapped module's original parameters, names, owners
  wrap.py            which submodules become stage-3 units
  stage12.py         stages 1 and 2 (replicated params, GradBucketer buckets)
  stage3.py          stage 3 (per-unit gather, prefetch, saved-tensor hooks)
  mixed_precision.py MixedPrecision policy
  clip.py            global-norm gradient clipping that knows which tensors are shards
  hybrid.py          hybrid sharding's groups: shard within a node, replicate across nodes
  state_dict.py      full (consolidated) model/optimizer state dicts, load at any size/stage
  checkpoint.py      crash-safe sharded save/load, resharding
  memory.py          bytes held in params/grads/optimizer state
  fsdp.py            FullyShardedDataParallel
"""
from .clip import clip_grad_norm_
from .fsdp import FullyShardedDataParallel
from .layout import FlatLayout
from .mixed_precision import MixedPrecision

__all__ = ["FullyShardedDataParallel", "MixedPrecision", "FlatLayout", "clip_grad_norm_"]
