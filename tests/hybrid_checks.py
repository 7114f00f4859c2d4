"""Node-aware groups and hybrid sharding (shard within a node, replicate across nodes), checked on
every rank. Written once and run by tests/test_hybrid.py (4 gloo processes made 2 "nodes" × 2 by
LOCAL_WORLD_SIZE=2) and by the torchrun jobs of tests/test_multinode.py (gloo, 2 agents × 2) and
tests/test_multinode_gpu.py (NCCL over sockets, 2 agents × 1 GPU), through multinode_worker.py.

Every training check compares with one process training the unwrapped model on the global batch
(test_zero's Net, data, AdamW, and its bounds derived from the numerics: tests/numerics.py).
"""
import functools
import os
import warnings

import pytest
import torch

import pynccl
from pynccl.comm.nodes import NodeLayout, node_layout
from pynccl.mesh import ParallelMesh

import test_zero
from test_zero import GRAD_RTOL, LR, STEPS, global_batch, local, make_net


def device():
    return pynccl.get_device()


def train(model, opt, steps, rank, ws, clip=None):
    """The loop users write, on this rank's slice of each global batch; returns the clip norms."""
    norms = []
    for step in steps:
        idx, tgt = (t.to(device()) for t in local(global_batch(step), rank, ws))
        model(idx, tgt).backward()
        if clip is not None:
            clip_fn = getattr(model, "clip_grad_norm_", None) or functools.partial(
                torch.nn.utils.clip_grad_norm_, model.parameters())
            norms.append(float(clip_fn(clip)))
        opt.step()
        opt.zero_grad()
    return norms


def reference(steps=range(STEPS), clip=None):
    """One process, the unwrapped model, the whole global batch: ({key: (value, element-wise
    bound)}, clip norms) — test_zero's reference."""
    return test_zero.reference(steps, clip=clip)


def assert_close(actual, expected, what):
    """actual: a state dict (any device); expected: reference()'s {key: (value, bound)}."""
    test_zero.assert_close({k: v.cpu() for k, v in actual.items()}, expected, what)


def node_groups():
    """torch FSDP's HYBRID_SHARD pair: (this node's ranks, this rank's peers on the other nodes).
    Collective: every rank creates every group."""
    shard, _ = pynccl.new_subgroups()                  # group_size=None: one per node
    replicate = None
    for ranks in node_layout().inter_node_groups():
        group = pynccl.new_group(ranks)
        if pynccl.get_rank() in ranks:
            replicate = group
    return shard, replicate


def wrap(stage, perturb=False, **kw):
    """perturb: start from other values than rank 0's (sync_module_states must replace them)."""
    net = make_net()
    if perturb:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    model = pynccl.FullyShardedDataParallel(net, stage=stage, bucket_cap_mb=0.0005, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


# ---------------------------------------------------------------------- node-aware groups
def check_node_layout(rank, ws, ranks_per_node):
    layout = node_layout()
    assert layout == NodeLayout.uniform(ws, ranks_per_node), layout
    node = rank // ranks_per_node
    mine, subgroups = pynccl.new_subgroups()
    assert mine.ranks == layout.ranks(node)
    # as torch's: one entry per node, GroupMember.NON_GROUP_MEMBER for the nodes this rank is not on
    assert [g.ranks if i == node else g for i, g in enumerate(subgroups)] == \
        [ranks if i == node else pynccl.GroupMember.NON_GROUP_MEMBER for i, ranks in enumerate(layout.nodes)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # TP within a node: no warning
        mesh = ParallelMesh(dp=None, tp=ranks_per_node, dp_shard=None)
    assert mesh.tp_group.ranks == layout.ranks(node)  # TP intra-node, DP across nodes
    assert mesh.dp_group.ranks == [r for r in range(ws) if r % ranks_per_node == rank % ranks_per_node]
    with pytest.warns(UserWarning, match=r"tensor-parallel groups span nodes.*node 0 = ranks 0"):
        ParallelMesh(dp=None, tp=2 * ranks_per_node)
    hybrid = ParallelMesh(dp=None, dp_shard="node")
    assert hybrid.dp_shard_group.ranks == layout.ranks(node)
    replicate = None if hybrid.dp_replicate_group is None else hybrid.dp_replicate_group.ranks
    assert replicate == mesh.dp_group.ranks, (replicate, mesh.dp_group.ranks)
    assert (hybrid.dp_replicate_rank, hybrid.dp_shard_rank) == (node, rank % ranks_per_node)


# ---------------------------------------------------------------------- hybrid sharding
def _new_entries(group, since):
    return [e for e in pynccl.flight_record(group) if e["seq"] > since]


def _last_seq(group):
    record = pynccl.flight_record(group)
    return record[-1]["seq"] if record else 0


def check_hybrid_training(rank, ws, shard, replicate):
    """Stages 1-3 with process_group=(shard, replicate), every rank but 0 starting from other
    values: parameters and clip norms after 5 steps equal one process; the replicas hold
    identical shards; the only collectives between the shard groups are one all-reduce per unit
    and step, of its shard's size."""
    plain = reference()[0]
    clipped, ref_norms = reference(clip=0.5)
    assert min(ref_norms) > 0.5, "the clip threshold must be active for the check to mean anything"
    world = pynccl.get_default_group()
    for stage in (1, 2, 3):
        model, opt = wrap(stage, perturb=rank != 0, process_group=(shard, replicate))
        assert model.process_group is shard and model.replicate_group is replicate
        train(model, opt, range(1), rank, ws)
        world_seq, rep_seq = _last_seq(world), _last_seq(replicate)
        train(model, opt, range(1, STEPS), rank, ws)
        assert _new_entries(world, world_seq) == [], f"stage {stage}: a collective ran over the whole world"
        ops = _new_entries(replicate, rep_seq)
        assert sorted((e["op"], e["count"]) for e in ops) == sorted(
            ("all_reduce", u.layout.shard_numel) for u in model.units for _ in range(STEPS - 1)), ops
        assert_close(model.full_state_dict(), plain, f"hybrid stage {stage}")
        for u in model.units:                          # every replica holds the same shard, bit for bit
            copies = [torch.empty_like(u.shard) for _ in range(replicate.world_size)]
            pynccl.all_gather(copies, u.shard.detach(), group=replicate)
            assert all(torch.equal(c, copies[0]) for c in copies), f"stage {stage}: replicas differ"

        model, opt = wrap(stage, process_group=(shard, replicate))
        norms = train(model, opt, range(STEPS), rank, ws, clip=0.5)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=GRAD_RTOL, atol=0)
        assert_close(model.full_state_dict(), clipped, f"hybrid stage {stage} clipped")


def check_hybrid_mixed_precision(rank, ws, shard, replicate):
    """bf16 compute with fp32 reductions: both collectives of the reduce run in the reduce dtype
    (test_zero's emulation of MixedPrecision and its derived bounds)."""
    from test_zero import reference_mixed
    from pynccl.zero import MixedPrecision
    expected, _ = reference_mixed(ws, torch.float32)
    model, opt = wrap(3, process_group=(shard, replicate),
                      mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    train(model, opt, range(STEPS), rank, ws)
    assert_close(model.full_state_dict(), expected, "hybrid stage 3, bf16 compute, fp32 reductions")


def check_hybrid_meshes(rank, ws, ranks_per_node):
    """The same through ParallelMesh(dp_shard="node") and through torch's 2-D DeviceMesh
    (FSDP2's HSDP: dims (replicate, shard))."""
    plain = reference()[0]
    mesh = ParallelMesh(dp=None, dp_shard="node")
    model, opt = wrap(3, mesh=mesh)
    assert model.process_group is mesh.dp_shard_group and model.replicate_group is mesh.dp_replicate_group
    train(model, opt, range(STEPS), rank, ws)
    assert_close(model.full_state_dict(), plain, "hybrid stage 3 through ParallelMesh")
    tmesh = torch.distributed.init_device_mesh("cpu", (ws // ranks_per_node, ranks_per_node),
                                               mesh_dim_names=("replicate", "shard"))
    model, opt = wrap(2, mesh=tmesh)
    assert model.process_group.ranks == node_layout().ranks(rank // ranks_per_node)
    train(model, opt, range(STEPS), rank, ws)
    assert_close(model.full_state_dict(), plain, "hybrid stage 2 through a torch DeviceMesh")


def check_hybrid_checkpoints(rank, ws, shard, replicate, tmp):
    """The first replica writes one file per shard rank; a hybrid run of another stage and a plain
    ZeRO run over all ranks (resharded) both resume from them and end where one process does; a
    save that fails on one writer raises on every rank and leaves the previous files."""
    plain = reference()[0]
    path = os.path.join(tmp, "hybrid_ckpt")
    model, opt = wrap(3, process_group=(shard, replicate))
    train(model, opt, range(2), rank, ws)
    model.save_sharded(path, opt)
    assert sorted(os.listdir(path)) == [f"rank{r:05d}-of-{shard.world_size:05d}.pt" for r in range(shard.world_size)]
    for kwargs, what in (({"process_group": (shard, replicate)}, "hybrid stage 3 -> hybrid stage 1"),
                         ({}, "hybrid stage 3 -> stage 2 over every rank")):
        resumed, resumed_opt = wrap(1 if kwargs else 2, **kwargs)
        resumed.load_sharded(path, resumed_opt)
        train(resumed, resumed_opt, range(2, STEPS), rank, ws)
        assert_close(resumed.full_state_dict(), plain, what)

    real_save = torch.save

    def broken(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full (simulated)")
    writer_fails = replicate.rank == 0 and shard.rank == shard.world_size - 1
    torch.save = broken if writer_fails else real_save
    try:
        with pytest.raises(RuntimeError, match="previous checkpoint there is intact"):
            model.save_sharded(path, opt)
    finally:
        torch.save = real_save
    fresh, fresh_opt = wrap(3, process_group=(shard, replicate))
    fresh.load_sharded(path, fresh_opt)
    train(fresh, fresh_opt, range(2, STEPS), rank, ws)
    assert_close(fresh.full_state_dict(), plain, "hybrid checkpoint after a failed save")


def check_hybrid_errors(rank, ws, shard, replicate):
    """Groups that do not form a shard × replicate grid are refused, naming the groups."""
    world = pynccl.get_default_group()
    with pytest.raises(ValueError, match=r"\(shard_group, replicate_group\), got 3 groups"):
        pynccl.FullyShardedDataParallel(make_net(), process_group=(shard, replicate, world))
    with pytest.raises(ValueError, match="must have only this rank"):
        pynccl.FullyShardedDataParallel(make_net(), process_group=(world, replicate))
    with pytest.raises(ValueError, match="process_group or mesh, not both"):
        pynccl.FullyShardedDataParallel(make_net(), process_group=shard, mesh=object())
    # Replicas pairing different shard ranks: (0, 3) and (1, 2) on 2 nodes × 2.
    crossed = None
    for ranks in ([0, 3], [1, 2]):
        group = pynccl.new_group(ranks)
        if rank in ranks:
            crossed = group
    with pytest.raises(ValueError, match="must hold the same shard"):
        pynccl.FullyShardedDataParallel(make_net(), process_group=(shard, crossed))
