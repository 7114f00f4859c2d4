"""ZeRO stages 1-3 (optimizer state, gradients, parameters sharded) for a plain torch
optimizer and an ordinary training loop. See fsdp.py for the user-facing contract.

Files, one responsibility each:
  layout.py          flat shard layout (pure index arithmetic)
  flat_unit.py       a unit's master shard + full buffer; gather / free / reduce-scatter
  params.py          the wrapped module's original parameters, names, owners
  wrap.py            which submodules become stage-3 units
  stage12.py         stages 1 and 2 (replicated params, GradBucketer buckets)
  stage3.py          stage 3 (per-unit gather, prefetch, saved-tensor hooks)
  placeholder.py     stage 3: what a parameter's attribute holds outside its unit's forward (no data; ops raise)
  root_calls.py      calls of the wrapped module outside the wrapper's forward (model.module(...), generate)
  mixed_precision.py MixedPrecision policy
  clip.py            global-norm gradient clipping that knows which tensors are shards
  grad_scaler.py     ShardedGradScaler: fp16 loss scaling whose inf check covers every rank's shard
  hybrid.py          hybrid sharding's groups: shard within a node, replicate across nodes
  state_dict.py      full (consolidated) model/optimizer state dicts, load at any size/stage
  row_exchange.py    rows between ZeRO's flat layout and torch.chunk's Shard(0) chunks (all_to_all)
  sharded_state.py   sharded state dicts as DTensors (FSDP2's form) and back
  dcp.py             torch.distributed.checkpoint entry points (get_/set_*_state_dict)
  state_dict_type.py FSDP1's set_state_dict_type / state_dict_type: what model.state_dict() returns
  hf_save.py         save_pretrained of a sharded Hugging Face model, gathered unit by unit
  checkpoint.py      crash-safe sharded save/load, resharding
  memory.py          bytes held in params/grads/optimizer state
  fsdp.py            FullyShardedDataParallel
"""
from .._lazy import lazy_exports
from .clip import clip_grad_norm_
from .fsdp import FullyShardedDataParallel
from .grad_scaler import ShardedGradScaler
from .hf_save import save_pretrained
from .layout import FlatLayout
from .mixed_precision import MixedPrecision

# torch.distributed.checkpoint and DTensor take seconds to import: dcp.py loads on first use.
_DCP_NAMES = ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict",
              "set_optimizer_state_dict", "set_state_dict")

__getattr__, __dir__ = lazy_exports(__name__, "dcp", _DCP_NAMES, globals())

__all__ = ["FullyShardedDataParallel", "MixedPrecision", "FlatLayout", "clip_grad_norm_", "ShardedGradScaler",
           "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict",
           "set_optimizer_state_dict", "set_state_dict", "save_pretrained"]
