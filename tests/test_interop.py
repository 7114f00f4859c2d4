"""Interop with torch.distributed (issue #17 item 4), on gloo against torch.distributed's own
results on the same data: torch groups (new_group, use_local_synchronization, DeviceMesh) accepted
by collectives, DDP and ZeRO; pynccl groups handed to torch; torch's positional init order; the
c10d functions pynccl adds (subgroups, split_group, rank queries, object collectives,
monitored_barrier, all_reduce_coalesced, Work.get_future, per-op batch_isend_irecv, any-source
recv). One run at world size 3 does most of it, one at 2 the point-to-point cases; the `multigpu`
tests run the nccl side of the same functions.
"""
import datetime
import time
import types

import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
import torch.distributed as tdist
from torch import nn

import pynccl
from pynccl.comm.backends.base import Backend
from pynccl.comm.groups import resolve_group
from pynccl.testing import run_multiprocess

from test_zero import STEPS, LR, make_net, reference, train, assert_close  # noqa: E402 - ZeRO's reference run
from numerics import assert_within, chain_rtol  # noqa: E402


def _torch_groups(rank):
    """Torch groups of three kinds map to pynccl groups of the same ranks; collectives on them
    equal torch's on the same data."""
    world = pynccl.get_default_group()
    assert resolve_group(tdist.group.WORLD) is world
    tg = tdist.new_group([0, 2])                                   # every rank calls it, as torch requires
    mesh = tdist.init_device_mesh("cpu", (3, 1), mesh_dim_names=("dp", "tp"))
    assert resolve_group(mesh.get_group("dp")) is world
    tp = resolve_group(mesh.get_group("tp"))                        # one rank each: made by its member alone
    assert tp.ranks == [rank] and pynccl.get_world_size(mesh.get_group("tp")) == 1
    x = torch.arange(4, dtype=torch.float32) + rank
    pynccl.all_reduce(x, group=mesh.get_group("tp"))
    assert torch.equal(x, torch.arange(4, dtype=torch.float32) + rank)
    _check_mapped(rank, tg, [0, 2])
    with pytest.raises(TypeError, match="torch.distributed ProcessGroup"):
        pynccl.all_reduce(x, group="world")
    return tg


def _check_mapped(rank, group, ranks):
    if rank in ranks:
        g = resolve_group(group)
        assert g is resolve_group(group) and g.ranks == ranks       # made once, cached
        assert pynccl.get_rank(group) == tdist.get_rank(group) and pynccl.get_world_size(group) == 2
        mine, theirs = torch.arange(5, dtype=torch.float32) * (rank + 1), torch.arange(5, dtype=torch.float32) * (rank + 1)
        pynccl.all_reduce(mine, group=group)
        tdist.all_reduce(theirs, group=group)
        assert torch.equal(mine, theirs) and torch.equal(mine, torch.arange(5.0) * sum(r + 1 for r in ranks))
        mine, theirs = torch.full((3,), float(rank)), torch.full((3,), float(rank))
        pynccl.broadcast(mine, src=ranks[1], group=group)
        tdist.broadcast(theirs, src=ranks[1], group=group)
        assert torch.equal(mine, theirs) and torch.equal(mine, torch.full((3,), float(ranks[1])))
        out = torch.empty(4)
        pynccl.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=group)
        assert out.tolist() == [float(ranks[0])] * 2 + [float(ranks[1])] * 2
        y = pynccl.tensor_parallel.reduce_from_tensor_parallel_region(torch.full((2,), rank + 1.0), group=group)
        assert y.tolist() == [float(sum(r + 1 for r in ranks))] * 2           # TP's autograd functions too
        # the way back: the torch group a pynccl group was mapped from
        assert g.torch_group is group and pynccl.to_torch_group(g) is group
        assert pynccl.get_global_rank(group, 1) == tdist.get_global_rank(group, 1) == ranks[1]
        assert pynccl.get_group_rank(group, ranks[1]) == tdist.get_group_rank(group, ranks[1]) == 1
        with pytest.raises(ValueError, match="not a rank of group"):
            pynccl.get_group_rank(group, 3 - sum(ranks))   # the third rank


def _wrappers(rank, tg):
    """DDP and ZeRO stage 1 take a torch group as process_group, with the same result as torch's
    DDP on that group and as a single-process run."""
    if rank not in (0, 2):
        return
    group_rank = tdist.get_rank(tg)
    torch.manual_seed(0)
    ours, theirs = nn.Linear(6, 3), nn.Linear(6, 3)
    theirs.load_state_dict(ours.state_dict())
    ours = pynccl.DistributedDataParallel(ours, process_group=tg)
    theirs = nn.parallel.DistributedDataParallel(theirs, process_group=tg)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank))
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    for p, q in zip(ours.module.parameters(), theirs.module.parameters()):
        # The same local backward; 2 ranks' gradients summed in another order and scaled by 1/2
        # before or after: 3·eps of their size (tests/numerics.py).
        assert_within(p.grad, q.grad, chain_rtol(3) * q.grad.abs().max().item(), "DDP on a torch group: grad")
    model = pynccl.FullyShardedDataParallel(make_net(), stage=1, process_group=tg, bucket_cap_mb=0.0005)
    assert model.process_group is resolve_group(tg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, opt, range(STEPS), group_rank, 2)
    assert_close(model.full_state_dict(), reference()[0], "stage 1 on a torch group")


def _new_functions(rank, ws):
    """Each against torch.distributed's own result on the same data, or closed form."""
    assert pynccl.is_available() and pynccl.is_gloo_available()
    assert pynccl.is_nccl_available() == (pynccl._ext._C is not None)
    # new_subgroups / by_enumeration: the same ranks as torch's
    mine, subs = pynccl.new_subgroups(group_size=1)
    tmine, tsubs = tdist.new_subgroups(group_size=1)
    # as torch's: NON_GROUP_MEMBER for the blocks a rank is not in
    def ranks_of(groups, get_ranks):
        return [None if g is pynccl.GroupMember.NON_GROUP_MEMBER else get_ranks(g) for g in groups]
    assert ranks_of(subs, lambda g: g.ranks) == ranks_of(tsubs, tdist.get_process_group_ranks) == \
        [[r] if r == rank else None for r in range(ws)]
    assert mine.ranks == tdist.get_process_group_ranks(tmine) == [rank]
    mine, subs = pynccl.new_subgroups_by_enumeration([[0, 2], [1]])
    tmine, _ = tdist.new_subgroups_by_enumeration([[0, 2], [1]])
    assert mine.ranks == tdist.get_process_group_ranks(tmine) == ([0, 2] if rank != 1 else [1])
    a, b = torch.tensor([rank + 1.0]), torch.tensor([rank + 1.0])
    pynccl.all_reduce(a, group=mine)
    tdist.all_reduce(b, group=tmine)
    assert torch.equal(a, b)
    # split_group (torch's is NCCL-only): closed form
    sub = pynccl.split_group(split_ranks=[[0, 1], [2]])
    assert sub.ranks == ([0, 1] if rank < 2 else [2])
    c = torch.tensor([rank + 1.0])
    pynccl.all_reduce(c, group=sub)
    assert c.item() == 3.0                                        # 1 + 2, or 3 alone
    none = pynccl.split_group(split_ranks=[[0, 1]])
    assert (none is pynccl.GroupMember.NON_GROUP_MEMBER) == (rank == 2)
    # object collectives, non-zero roots
    obj = {"rank": rank, "payload": "x" * (rank * 7)}
    ours = [None] * ws if rank == 1 else None
    theirs = [None] * ws if rank == 1 else None
    pynccl.gather_object(obj, ours, dst=1)
    tdist.gather_object(obj, theirs, dst=1)
    assert ours == theirs and (rank != 1 or ours[2] == {"rank": 2, "payload": "x" * 14})
    inputs = [{"to": r, "blob": list(range(r * 5))} for r in range(ws)] if rank == 2 else None
    ours, theirs = [None], [None]
    pynccl.scatter_object_list(ours, inputs, src=2)
    tdist.scatter_object_list(theirs, inputs, src=2)
    assert ours == theirs == [{"to": rank, "blob": list(range(rank * 5))}]
    # all_reduce_coalesced: one flat all-reduce per dtype, as torch's per-tensor all-reduces
    tensors = [torch.arange(3.0) + rank, torch.arange(2, dtype=torch.float64) * rank, torch.full((2, 2), rank + 1.0)]
    expected = [t.clone() for t in tensors]
    for t in expected:
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    fut = pynccl.all_reduce_coalesced(tensors, op=pynccl.ReduceOp.MAX, async_op=True)
    assert isinstance(fut, torch._C.Future) and fut.wait() == tensors   # torch returns a Future too
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    # all_gather_coalesced (deprecated in torch, with a FutureWarning): torch's result
    inputs = [torch.arange(3.0) + rank, torch.full((2, 2), 10.0 * rank)]
    ours = [[torch.empty_like(t) for t in inputs] for _ in range(ws)]
    theirs = [[torch.empty_like(t) for t in inputs] for _ in range(ws)]
    with pytest.warns(FutureWarning, match="deprecated"):
        assert pynccl.all_gather_coalesced(ours, inputs) is None
    with pytest.warns(FutureWarning):
        tdist.all_gather_coalesced(theirs, inputs)
    assert all(torch.equal(a, b) for ra, rb in zip(ours, theirs) for a, b in zip(ra, rb))
    assert torch.equal(ours[2][1], torch.full((2, 2), 20.0))
    # Work.get_future: value is [tensor], after AVG's division; then() chains; torch's agrees
    t, u = torch.arange(4.0) * (rank + 1), torch.arange(4.0) * (rank + 1)
    fut = pynccl.all_reduce(t, op=pynccl.ReduceOp.AVG, async_op=True).get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2)
    tfut = tdist.all_reduce(u, async_op=True).get_future()
    assert torch.equal(doubled.wait(), tfut.wait()[0] / ws * 2) and fut.value()[0] is t
    # monitored_barrier: all arrive (as torch's), then rank 1 stays away and is named, in bounded time
    pynccl.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    tdist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    probe = pynccl.new_group([0, 1, 2])
    if rank != 1:
        start = time.monotonic()
        with pytest.raises(pynccl.CommTimeoutError, match="Rank 1 failed to pass monitoredBarrier"):
            pynccl.monitored_barrier(probe, timeout=1.0, wait_all_ranks=True)
        assert time.monotonic() - start < 5.0
    pynccl.barrier()


def _ws3(rank, ws):
    # torch's positional order: backend, init_method, timeout (a timedelta), world_size, rank
    pynccl.init_process_group("gloo", None, datetime.timedelta(seconds=90), ws, rank)
    assert pynccl.get_default_group().timeout_s == 90.0 and pynccl.get_rank() == rank
    try:
        tg = _torch_groups(rank)
        _wrappers(rank, tg)
        # a pynccl group handed to torch: its torch group carries torch's collectives
        g = pynccl.new_group([0, 1])
        if rank in (0, 1):
            tg01 = pynccl.to_torch_group(g)
            assert tdist.get_process_group_ranks(tg01) == [0, 1] and resolve_group(tg01) is g
            x = torch.tensor([rank + 5.0])
            tdist.all_reduce(x, group=g.torch_group)
            assert x.item() == 11.0
        _new_functions(rank, ws)
    finally:
        pynccl.destroy_process_group()
    return True


def test_interop_world_size_3():
    assert run_multiprocess(_ws3, 3, backend=None, timeout=300) == [True] * 3


def _members_only_torch_group(rank, ws):
    # NOTE: first thing after init, in a job of its own: torch names a use_local_synchronization
    # group from a salt each rank keeps (torch 2.11: the groups it is in; 2.14: a count that such a
    # group advances on its members only), so after groups only some ranks are in, torch's own
    # new_group here gets different names on ranks 1 and 2 and hangs (torch 2.11 in _ws3's order).
    if rank in (1, 2):
        _check_mapped(rank, tdist.new_group([1, 2], use_local_synchronization=True), [1, 2])
    pynccl.barrier()      # rank 0 hosts the store: it leaves only once the others are done with it
    return True


def test_torch_members_only_group_maps():
    assert run_multiprocess(_members_only_torch_group, 3, backend="gloo", timeout=120) == [True] * 3


def _p2p(rank, ws):
    reqs = pynccl.batch_isend_irecv([pynccl.P2POp(pynccl.isend, torch.full((3,), rank + 1.0), 1 - rank),
                                     pynccl.P2POp(pynccl.irecv, got := torch.empty(3), 1 - rank)])
    assert len(reqs) == 2
    for w in reqs:
        w.wait()
    assert torch.equal(got, torch.full((3,), 2.0 - rank))
    if rank == 1:
        pynccl.send(torch.tensor([7.0, 8.0]), 0)
        pynccl.send_object_list([{"a": 1}, "two", [3]], 0)
        pynccl.send_object_list([None, 4.5], 0)
    else:
        buf = torch.empty(2)
        assert pynccl.recv(buf) == 1 and buf.tolist() == [7.0, 8.0]        # any source: returns the sender
        objs = [None] * 3
        assert pynccl.recv_object_list(objs) == 1 and objs == [{"a": 1}, "two", [3]]
        objs = [None] * 2
        assert pynccl.recv_object_list(objs, src=1) == 1 and objs == [None, 4.5]
        with pytest.raises(NotImplementedError, match="recv"):
            pynccl.irecv(buf)
    return True


def test_p2p_world_size_2():
    assert run_multiprocess(_p2p, 2, backend="gloo", timeout=120) == [True] * 2


def test_any_source_on_nccl_names_the_alternative():
    fake_nccl = types.SimpleNamespace(name="nccl")
    with pytest.raises(ValueError, match="NCCL has no any-source receive. Pass src="):
        Backend.recv_any_source(fake_nccl, torch.empty(1))


def test_init_process_group_signature_is_torchs():
    import inspect
    ours = list(inspect.signature(pynccl.init_process_group).parameters)
    theirs = list(inspect.signature(tdist.init_process_group).parameters)
    # torch's documented nine, in order (torch 2.14 has private ones after them); then pynccl's own
    assert ours == theirs[:9] + ["check_collectives"] and theirs[8] == "device_id"
    assert inspect.signature(pynccl.init_process_group).parameters["check_collectives"].kind == inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError, match="pg_options must be a pynccl NcclOptions"):
        pynccl.init_process_group("gloo", pg_options=object())


def test_backend_names_as_torch_takes_them():
    """torch's spellings of a backend map to pynccl's one backend per group (a comm-free check)."""
    from pynccl.comm.backend_names import parse_backend
    for given, expected in [("nccl", "nccl"), ("NCCL", "nccl"), (tdist.Backend.NCCL, "nccl"), ("gloo", "gloo"),
                            (tdist.Backend.GLOO, "gloo"), ("cpu:gloo,cuda:nccl", "nccl"), ("cuda:nccl,cpu:gloo", "nccl"),
                            ("cuda:nccl", "nccl"), ("cpu:gloo", "gloo")]:
        assert parse_backend("f", given) == expected, given
    for bad in ("mpi", "cuda:gloo", "cpu:gloo,cpu:gloo", "cpu"):
        with pytest.raises(ValueError, match="f: backend"):
            parse_backend("f", bad)


# ----------------------------------------------------------------------------- GPU (nccl)
def _nccl_case(rank, ws):
    dev = torch.device("cuda", torch.cuda.current_device())
    tg = tdist.new_group(list(range(ws)))                      # full world -> the default communicator
    sub = tdist.new_group([0, 1])                              # ws > 2: a members-only nccl communicator
    if rank in (0, 1):
        assert resolve_group(sub).ranks == [0, 1] and pynccl.get_backend(sub) == "nccl"
        x = torch.full((4,), rank + 1.0, device=dev)
        pynccl.all_reduce(x, group=sub)
        assert x.tolist() == [3.0] * 4
        y = torch.arange(4.0, device=dev) * (rank + 1)
        fut = pynccl.all_reduce(y, op=pynccl.ReduceOp.AVG, group=sub, async_op=True).get_future()
        assert torch.equal(fut.then(lambda f: f.value()[0] * 2).wait().cpu(), torch.arange(4.0) * 3)
    assert resolve_group(tg) is pynccl.get_default_group()
    objs = [None] * ws if rank == 0 else None
    pynccl.gather_object({"r": rank}, objs, dst=0)
    assert rank != 0 or objs == [{"r": r} for r in range(ws)]
    out = [None]
    pynccl.scatter_object_list(out, [r * 10 for r in range(ws)] if rank == ws - 1 else None, src=ws - 1)
    assert out == [rank * 10]
    t = torch.tensor([1.0, 2.0], device=dev)
    w = pynccl.all_reduce_coalesced([t, torch.ones(3, dtype=torch.float64, device=dev)], async_op=True)
    w.wait()
    assert t.tolist() == [float(ws), 2.0 * ws]
    probe = pynccl.new_group(list(range(ws)))
    if rank != 1:
        start = time.monotonic()
        with pytest.raises(pynccl.CommTimeoutError, match="Rank 1 failed"):
            pynccl.monitored_barrier(probe, timeout=2.0)
        assert time.monotonic() - start < 8.0
    pynccl.monitored_barrier(timeout=60)
    return True


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_interop_nccl_multi_gpu():
    ws = min(torch.cuda.device_count(), 4)   # at 3+, torch group [0, 1] gets a members-only communicator
    assert run_multiprocess(_nccl_case, ws, backend="nccl", start_method="spawn", timeout=300) == [True] * ws



def _torch_code_after_pynccl_init(rank, ws):
    """After pynccl.init_process_group("nccl"), torch code runs as after torch's own init with
    "cpu:gloo,cuda:nccl" (issue 29): torch.distributed's collectives on CUDA and CPU tensors,
    init_device_mesh("cuda") with a DTensor op, and FSDP2's fully_shard training as one process."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dev = torch.device("cuda", torch.cuda.current_device())
    assert "cuda:nccl" in str(tdist.get_backend_config())
    t = torch.full((4,), rank + 1.0, device=dev)
    tdist.all_reduce(t)
    c = torch.full((2,), rank + 1.0)
    tdist.all_reduce(c, op=tdist.ReduceOp.MAX)                 # CPU tensors: torch's gloo side
    total = ws * (ws + 1) / 2
    assert t.tolist() == [total] * 4 and c.tolist() == [float(ws)] * 2
    # DTensor on a CUDA mesh: a sum across the shards
    mesh = init_device_mesh("cuda", (ws,))
    x = torch.arange(ws * 4 * 3, dtype=torch.float32, device=dev).view(ws * 4, 3)   # the same on every rank
    dx = distribute_tensor(x, mesh, [Shard(0)])
    assert dx.to_local().shape == (4, 3)
    assert torch.equal((dx * 2).sum(dim=0).full_tensor(), (x * 2).sum(dim=0))
    # FSDP2: each rank's half of the batch; gradients averaged; equals one process on the whole batch
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
    model = copy.deepcopy(ref)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        xb = torch.randn(2 * ws, 8, generator=torch.Generator().manual_seed(step)).to(dev)
        model(xb[2 * rank: 2 * rank + 2]).square().mean().backward()
        ref(xb).square().mean().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    # NOTE: fp32 sums of at most 16 products and a 2-term average per step, 3 SGD steps: far below 1e-5
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    # pynccl's side of the same semantics on NCCL
    objs = [{"from": rank}] if rank == 0 else [None]
    pynccl.broadcast_object_list(objs, src=0, device="cpu")       # the other device type: torch's own function
    assert objs == [{"from": 0}]
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    a, b = torch.full((3,), rank + 1.0, device=dev), torch.zeros(3, device=dev)
    works = pynccl.batch_isend_irecv([pynccl.P2POp(pynccl.isend, a, nxt), pynccl.P2POp(pynccl.irecv, b, prv)])
    theirs = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, a, nxt), tdist.P2POp(tdist.irecv, b.clone(), prv)])
    assert len(works) == len(theirs) == 1                        # NCCL coalesces the batch, as torch's
    works[0].wait()
    for w in theirs:
        w.wait()
    assert b.tolist() == [prv + 1.0] * 3
    return True


def _work_wait_and_groups_on_nccl(rank, ws):
    """pynccl's side of torch's semantics on NCCL: Work.wait(timedelta) bounded on the host, an
    async barrier, new_group's NON_GROUP_MEMBER."""
    dev = torch.device("cuda", torch.cuda.current_device())
    pynccl.barrier()                 # both ranks leave within ms of each other: rank 1's sleep delays its op
    if rank == 1:
        time.sleep(3.0)
    z = torch.ones(2, device=dev)
    w = pynccl.all_reduce(z, async_op=True)
    if rank == 0:                                                # Work.wait(timedelta): the host waits, bounded
        start = time.monotonic()
        with pytest.raises(pynccl.CommTimeoutError, match="did not complete within 0.5 s"):
            w.wait(datetime.timedelta(seconds=0.5))
        assert time.monotonic() - start < 2.0
    assert w.wait(datetime.timedelta(seconds=60)) and z.tolist() == [float(ws)] * 2
    pynccl.barrier(async_op=True).wait()
    g = pynccl.new_group([0])
    if rank != 0:
        assert g is pynccl.GroupMember.NON_GROUP_MEMBER and pynccl.get_rank(g) == -1
        with pytest.warns(UserWarning, match="does not belong to the given group"):
            assert pynccl.all_reduce(z, group=g) is None
    pynccl.barrier()
    return True


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_torch_code_after_pynccl_init_multi_gpu():
    assert run_multiprocess(_torch_code_after_pynccl_init, 2, backend="nccl", start_method="spawn",
                            timeout=120) == [True, True]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_work_wait_and_groups_multi_gpu():
    assert run_multiprocess(_work_wait_and_groups_on_nccl, 2, backend="nccl", start_method="spawn",
                            timeout=90) == [True, True]
