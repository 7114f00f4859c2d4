"""torch FSDP's sharding_strategy mapped to a ZeRO stage, by enum member (never by value).

FULL_SHARD (torch's default) shards parameters, gradients and optimizer state: stage 3, also
FullyShardedDataParallel's default. SHARD_GRAD_OP keeps parameters whole between forward and
backward and shards gradients and optimizer state: stage 2. NO_SHARD replicates everything, which
no ZeRO stage does (each shards at least the optimizer state): pynccl.DistributedDataParallel is
that. HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (shard within a node, replicate across nodes) are
stages 3 / 2 with hybrid sharding (hybrid.py): with process_group=(shard, replicate) or mesh=, as
given; with neither, one shard group per node, as torch FSDP builds them.
"""
from __future__ import annotations

from typing import Optional, Tuple

DEFAULT_STAGE = 3   # torch FSDP's default, FULL_SHARD


def resolve_stage(stage: Optional[int], sharding_strategy) -> Tuple[int, bool]:
    """(ZeRO stage, hybrid?) for FullyShardedDataParallel(stage=..., sharding_strategy=...):
    either, or neither (stage 3); both only if they agree."""
    if isinstance(stage, bool) or (stage is not None and stage not in (1, 2, 3)):
        hint = "" if isinstance(stage, int) else " (torch's FSDP takes process_group second: pass it as process_group=)"
        raise ValueError(f"FullyShardedDataParallel: stage must be 1, 2 or 3, got {stage!r}{hint}")
    if sharding_strategy is None:
        return (DEFAULT_STAGE if stage is None else stage), False
    mapped, hybrid = _stage_of(sharding_strategy)
    if stage is not None and stage != mapped:
        raise ValueError(f"FullyShardedDataParallel: stage={stage} contradicts sharding_strategy={sharding_strategy} "
                         f"(stage {mapped}); pass one of them")
    return mapped, hybrid


def _stage_of(strategy) -> Tuple[int, bool]:
    from torch.distributed.fsdp import ShardingStrategy
    stages = {ShardingStrategy.FULL_SHARD: (3, False), ShardingStrategy.SHARD_GRAD_OP: (2, False),
              ShardingStrategy.HYBRID_SHARD: (3, True)}
    zero2_hybrid = getattr(ShardingStrategy, "_HYBRID_SHARD_ZERO2", None)
    if zero2_hybrid is not None:
        stages[zero2_hybrid] = (2, True)
    for member, stage in stages.items():
        if strategy is member:
            return stage
    if strategy is ShardingStrategy.NO_SHARD:
        raise NotImplementedError("FullyShardedDataParallel: ShardingStrategy.NO_SHARD replicates parameters, "
                                  "gradients and optimizer state, which no ZeRO stage does; use "
                                  "pynccl.DistributedDataParallel")
    raise TypeError(f"FullyShardedDataParallel: sharding_strategy must be a torch.distributed.fsdp.ShardingStrategy, "
                    f"got {strategy!r}")
