"""Multi-node logic without processes (issue 28): the node layout, the mesh's hybrid and
node-aware arithmetic, and the per-attempt key space in torchrun's agent store (threads on
one in-memory store play the ranks of successive attempts)."""
import threading
import time

import pytest
import torch.distributed as tdist

from pynccl.comm.elastic_store import CURRENT_KEY, fresh_key_space
from pynccl.comm.nodes import NodeLayout, node_id_from_env
from pynccl.errors import CommTimeoutError
from pynccl.mesh import MeshShape


# ---------------------------------------------------------------------- node layout
def test_node_id_from_torchrun_variables():
    assert node_id_from_env({"GROUP_RANK": "3", "LOCAL_WORLD_SIZE": "8", "RANK": "1"}) == "node3"
    # launchers that set only LOCAL_WORLD_SIZE: the block of ranks RANK falls in
    assert node_id_from_env({"LOCAL_WORLD_SIZE": "4", "RANK": "9"}) == "node2"
    assert node_id_from_env({}).startswith("host:")


def test_node_layout_arithmetic():
    layout = NodeLayout.from_ids(["b", "b", "a", "a", "c", "c"])
    assert layout.node_of == (0, 0, 1, 1, 2, 2) and layout == NodeLayout.uniform(6, 2)
    assert layout.num_nodes == 3 and layout.ranks_per_node == 2 and layout.is_blocked
    assert layout.nodes == [[0, 1], [2, 3], [4, 5]] and layout.local_rank(5) == 1
    assert layout.inter_node_groups() == [[0, 2, 4], [1, 3, 5]]
    assert layout.spans_nodes([2, 3]) is False and layout.nodes_of([1, 4]) == [0, 2]
    assert str(layout) == "3 node(s) × 2 rank(s): node 0 = ranks 0-1, node 1 = ranks 2-3, node 2 = ranks 4-5"
    uneven = NodeLayout.from_ids(["x", "y", "x", "x"])              # ranks out of node order, unequal nodes
    assert uneven.nodes == [[0, 2, 3], [1]] and uneven.ranks_per_node is None and not uneven.is_blocked
    assert str(uneven) == "2 nodes of unequal size: node 0 = ranks 0,2-3, node 1 = ranks 1"
    with pytest.raises(ValueError, match="different numbers of ranks"):
        uneven.inter_node_groups()
    with pytest.raises(ValueError, match="3 ranks per node do not divide the world size 4"):
        NodeLayout.uniform(4, 3)


# ---------------------------------------------------------------------- mesh
def test_hybrid_axes_inside_dp():
    """dp_rank = dp_replicate_rank × dp_shard + dp_shard_rank, tp fastest, pp slowest."""
    shape = MeshShape(dp=4, tp=2, pp=2, dp_shard=2)
    assert (shape.shard, shape.replicate) == (2, 2)
    assert shape.groups("dp_shard")[:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert shape.groups("dp_replicate")[:4] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    for axis in ("dp_shard", "dp_replicate", "tp", "dp", "pp"):
        groups = shape.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(16)), axis    # a partition of the world
    # a shard group and a replicate group meet in exactly one rank; together they are the dp group
    for s in shape.groups("dp_shard"):
        for r in shape.groups("dp_replicate"):
            common = set(s) & set(r)
            assert len(common) <= 1
            if common:
                dp = next(g for g in shape.groups("dp") if common <= set(g))
                assert set(s) | set(r) <= set(dp)
    plain = MeshShape(dp=4, tp=2, pp=2)
    assert plain.groups("dp_shard") == plain.groups("dp") and plain.replicate == 1
    with pytest.raises(ValueError, match=r"dp_shard=3 must divide dp=4"):
        MeshShape(dp=4, tp=1, pp=1, dp_shard=3).validate(4)
    with pytest.raises(ValueError, match=r"dp_shard must be a positive int, got 0 \(dp=4, tp=1, pp=1, dp_shard=0\)"):
        MeshShape(dp=4, tp=1, pp=1, dp_shard=0).validate(4)
    with pytest.raises(ValueError, match="axis must be one of"):
        plain.groups("ep")


def test_tensor_parallel_across_nodes_is_named():
    nodes = NodeLayout.uniform(16, 8)
    assert MeshShape(dp=2, tp=8, pp=1).node_warnings(nodes) == []               # TP fills a node
    assert MeshShape(dp=4, tp=4, pp=1, dp_shard=2).node_warnings(nodes) == []   # TP within, hybrid DP
    [message] = MeshShape(dp=1, tp=16, pp=1).node_warnings(nodes)
    assert message.startswith("ParallelMesh(dp=1, tp=16, pp=1): 1 of 1 tensor-parallel groups span nodes, "
                              "e.g. ranks [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] on nodes [0, 1] "
                              "(2 node(s) × 8 rank(s): node 0 = ranks 0-7, node 1 = ranks 8-15)")
    assert message.endswith("use tp ≤ 8 dividing 8 (the ranks per node)")
    [message] = MeshShape(dp=4, tp=3, pp=1).node_warnings(NodeLayout.uniform(12, 4))  # 3 does not divide 4
    assert "2 of 4 tensor-parallel groups span nodes, e.g. ranks [3, 4, 5] on nodes [0, 1]" in message
    uneven = NodeLayout.from_ids(["a", "a", "a", "b"])
    assert "keep each TP group on one node" in MeshShape(dp=2, tp=2, pp=1).node_warnings(uneven)[0]


# ---------------------------------------------------------------------- elastic key space
def _attempt(store, world_size, order, delays=None, timeout_s=10.0):
    """Ranks of one attempt as threads, started in `order` (delays in s before each);
    returns each rank's key-space prefix (or the exception it raised)."""
    out = {}

    def rank_main(r):
        try:
            prefixed = fresh_key_space(store, r, world_size, timeout_s)
            prefixed.set(f"probe{r}", "1")              # usable as a store
            out[r] = prefixed
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e
    threads = []
    for i, r in enumerate(order):
        time.sleep((delays or {}).get(r, 0.0))
        threads.append(threading.Thread(target=rank_main, args=(r,)))
        threads[-1].start()
    for t in threads:
        t.join(timeout_s + 5)
    return out


def _space(store, prefixed, rank):
    """Whether a rank's store is the current attempt's: its probe is under the current nonce."""
    nonce = store.get(CURRENT_KEY).decode()
    return nonce if store.check([f"pynccl/elastic/{nonce}/probe{rank}"]) else None


def test_each_attempt_gets_its_own_key_space():
    store = tdist.HashStore()
    first = _attempt(store, 4, [0, 1, 2, 3])
    assert all(not isinstance(v, Exception) for v in first.values()), first
    nonce1 = store.get(CURRENT_KEY).decode()
    assert all(_space(store, first[r], r) == nonce1 for r in range(4))
    # The restarted ranks 1-3 start before the new rank 0: they read the last attempt's nonce,
    # find their slots taken, and wait for rank 0's.
    second = _attempt(store, 4, [3, 1, 2, 0], delays={0: 0.3})
    assert all(not isinstance(v, Exception) for v in second.values()), second
    nonce2 = store.get(CURRENT_KEY).decode()
    assert nonce2 != nonce1 and all(_space(store, second[r], r) == nonce2 for r in range(4))


def test_a_rank_missing_from_the_last_attempt_does_not_stay_there():
    """Rank 3 never claimed a slot in an attempt that never completed, and a world of 2 was sealed
    before: rank 3, restarting early, claims the stale slot, sees no seal for its world size,
    and moves to the new nonce as soon as rank 0 publishes it."""
    store = tdist.HashStore()
    store.set(CURRENT_KEY, "stale")
    for r in (0, 1, 2):
        store.add(f"pynccl/elastic/stale/rank{r}", 1)
    store.add("pynccl/elastic/stale/joined", 3)
    out = _attempt(store, 4, [3, 1, 2, 0], delays={0: 0.3})
    assert all(not isinstance(v, Exception) for v in out.values()), out
    nonce = store.get(CURRENT_KEY).decode()
    assert nonce != "stale" and all(_space(store, out[r], r) == nonce for r in range(4))
    store.set(CURRENT_KEY, "old2")                      # sealed for a world of 2; the new world has 4
    store.set("pynccl/elastic/old2/sealed", "2")
    out = _attempt(store, 4, [3, 2, 1, 0], delays={0: 0.3})
    nonce = store.get(CURRENT_KEY).decode()
    assert nonce != "old2" and all(_space(store, out[r], r) == nonce for r in range(4))


def test_no_rank_0_is_a_timeout_naming_the_attempt():
    store = tdist.HashStore()
    out = _attempt(store, 2, [1], timeout_s=0.3)
    assert isinstance(out[1], CommTimeoutError) and "never opened this attempt" in str(out[1])
    out = _attempt(store, 3, [0, 1], timeout_s=0.3)
    assert isinstance(out[0], CommTimeoutError) and "saw too few ranks arrive" in str(out[0])
