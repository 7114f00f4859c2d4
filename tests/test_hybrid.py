"""Hybrid sharding (issue 28): FullyShardedDataParallel(process_group=(shard, replicate)), through
ParallelMesh(dp_shard="node") and a torch DeviceMesh, with node-aware groups, on 4 gloo processes
that LOCAL_WORLD_SIZE=2 makes 2 nodes × 2 (the checks are in hybrid_checks.py; the same checks run
under real torchrun agents in test_multinode.py). One multi-process run does all of it."""
from pynccl.testing import run_multiprocess

import hybrid_checks as hc

RANKS_PER_NODE = 2


def _case(rank, ws, tmp):
    hc.check_node_layout(rank, ws, RANKS_PER_NODE)
    shard, replicate = hc.node_groups()
    hc.check_hybrid_training(rank, ws, shard, replicate)
    hc.check_hybrid_mixed_precision(rank, ws, shard, replicate)
    hc.check_hybrid_meshes(rank, ws, RANKS_PER_NODE)
    hc.check_hybrid_checkpoints(rank, ws, shard, replicate, tmp)
    hc.check_hybrid_errors(rank, ws, shard, replicate)
    return "ok"


def test_hybrid_sharding_two_nodes_of_two(tmp_path):
    out = run_multiprocess(_case, 4, args=(str(tmp_path),), timeout=300, env={"LOCAL_WORLD_SIZE": str(RANKS_PER_NODE)})
    assert out == ["ok"] * 4
