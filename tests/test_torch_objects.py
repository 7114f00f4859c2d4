"""torch's own objects handed to pynccl where torch code would hand them (issues 25 and 29): FSDP's
ShardingStrategy, MixedPrecisionPolicy (FSDP2) and MixedPrecision (FSDP1); tensor parallelism's
ParallelStyle objects and a 1-D DeviceMesh; torch's P2POp; GroupMember.NON_GROUP_MEMBER given to
a wrapper. Each is checked against torch's own result on the same data, or for the error that names
what pynccl cannot honour. Also: `import pynccl` stays cheap while dir() shows the lazy names, and
barrier(async_op=True) / Work.wait(timedelta) behave as torch's.
"""
import datetime
import subprocess
import sys
import time

import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
import torch.distributed as tdist
from torch import nn
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.tensor.parallel import ParallelStyle as TorchParallelStyle

import pynccl
from pynccl.testing import run_multiprocess
from repo_env import subprocess_env
from pynccl.zero.mixed_precision import MixedPrecision, check_policy
from pynccl.zero.sharding_strategy import resolve_stage

from test_zero import LR, STEPS, assert_close, make_net, reference_mixed, train  # noqa: E402


# ----------------------------------------------------------------------------- import and dir
def test_import_is_cheap_and_dir_shows_lazy_names():
    code = ("import sys, pynccl; loaded = sorted(m for m in sys.modules if m.startswith(('pynccl.zero', "
            "'pynccl.ddp', 'pynccl.tensor_parallel', 'pynccl.pipeline', 'pynccl.mesh')));"
            "assert not loaded, loaded;"
            "names = dir(pynccl); want = {'DistributedDataParallel', 'FullyShardedDataParallel', 'tensor_parallel',"
            " 'pipeline', 'comm_hooks', 'ParallelMesh', 'all_reduce', 'GroupMember'};"
            "assert want <= set(names), want - set(names); assert want <= set(pynccl.__all__);"
            "assert not any(m.startswith('pynccl.zero') for m in sys.modules);"
            "ns = {}; exec('from pynccl import *', ns);"
            "assert ns['FullyShardedDataParallel'] is pynccl.zero.FullyShardedDataParallel;"
            "assert ns['tensor_parallel'] is pynccl.tensor_parallel")
    env = subprocess_env()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- FSDP's options (no processes)
def test_sharding_strategy_maps_by_member():
    assert resolve_stage(None, None) == (3, False)                       # torch's default, FULL_SHARD
    assert resolve_stage(None, ShardingStrategy.FULL_SHARD) == (3, False)
    assert resolve_stage(None, ShardingStrategy.SHARD_GRAD_OP) == (2, False)
    assert resolve_stage(2, ShardingStrategy.SHARD_GRAD_OP) == (2, False) and resolve_stage(1, None) == (1, False)
    with pytest.raises(ValueError, match="stage=3 contradicts sharding_strategy"):
        resolve_stage(3, ShardingStrategy.SHARD_GRAD_OP)
    with pytest.raises(NotImplementedError, match="NO_SHARD .* use pynccl.DistributedDataParallel"):
        resolve_stage(None, ShardingStrategy.NO_SHARD)
    # shard within a node, replicate across nodes: hybrid sharding (zero/hybrid.py)
    assert resolve_stage(None, ShardingStrategy.HYBRID_SHARD) == (3, True)
    assert resolve_stage(None, ShardingStrategy._HYBRID_SHARD_ZERO2) == (2, True)
    with pytest.raises(TypeError, match="must be a torch.distributed.fsdp.ShardingStrategy"):
        resolve_stage(None, 1)   # the enum's value, not its member
    with pytest.raises(ValueError, match="takes process_group second"):
        resolve_stage(object(), None)


def test_mixed_precision_policies_map_field_by_field():
    bf, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    assert check_policy(MixedPrecisionPolicy(bf, f32, f16, False)) == MixedPrecision(bf, f32, False, f16)
    assert check_policy(MixedPrecisionPolicy()) == MixedPrecision()
    # FSDP1: the pynccl wrapper is the root instance, so cast_root_forward_inputs decides
    assert check_policy(TorchMixedPrecision(bf, f32)) == MixedPrecision(bf, f32, True)
    assert check_policy(TorchMixedPrecision(bf, cast_root_forward_inputs=False)) == MixedPrecision(bf, None, False)
    with pytest.raises(NotImplementedError, match="buffer_dtype=torch.bfloat16 is not supported"):
        check_policy(TorchMixedPrecision(bf, buffer_dtype=bf))
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads=True is not supported"):
        check_policy(TorchMixedPrecision(bf, keep_low_precision_grads=True))
    with pytest.raises(TypeError, match="MixedPrecisionPolicy \\(FSDP2\\)"):
        check_policy("bf16")


# ----------------------------------------------------------------------------- on gloo, 2 ranks
def _fsdp_with_torch_options(rank, ws):
    # The default shards parameters (stage 3): this rank holds about half of each.
    model = pynccl.FullyShardedDataParallel(make_net())
    assert model.stage == 3
    full = sum(p.numel() for p in make_net().parameters())
    assert sum(p.numel() for p in model.parameters()) < full
    assert pynccl.FullyShardedDataParallel(make_net(), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).stage == 2
    # torch's FSDP2 policy trains exactly as the pynccl policy it maps to, and as the reference
    ref, _ = reference_mixed(ws, torch.float32)        # {key: (value, derived bound)}
    states = []
    for mp in (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
               MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
        model = pynccl.FullyShardedDataParallel(make_net(), mixed_precision=mp, bucket_cap_mb=0.0005)
        train(model, torch.optim.AdamW(model.parameters(), lr=LR), range(STEPS), rank, ws)
        states.append(model.full_state_dict())
    assert_close(states[0], {k: (v, 0.0) for k, v in states[1].items()}, "MixedPrecisionPolicy vs pynccl's MixedPrecision")
    assert_close(states[0], ref, "MixedPrecisionPolicy vs the bf16 reference")
    # output_dtype: floating outputs cast, as FSDP2's
    x = torch.randn(2, 4)
    for stage in (2, 3):
        for output_dtype in (None, torch.float32):
            torch.manual_seed(0)
            m = pynccl.FullyShardedDataParallel(nn.Linear(4, 3), stage=stage, mixed_precision=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, output_dtype=output_dtype))
            assert m(x).dtype == (output_dtype or torch.bfloat16)
    return True


def _tp_plan_of_torch(rank, ws):
    """torch's styles and a 1-D DeviceMesh in pynccl's parallelize_module give what torch's own
    parallelize_module gives (DTensor), from weights that differ per rank (src_data_rank=0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as ttp

    def mlp(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    mesh = init_device_mesh("cpu", (ws,))
    plan = {"0": ttp.ColwiseParallel(), "2": ttp.RowwiseParallel()}
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(7))   # the same input on every rank
    ours = pynccl.tensor_parallel.parallelize_module(mlp(100 + rank), mesh, plan)
    theirs = ttp.parallelize_module(mlp(100 + rank), mesh, plan)
    out_ours, out_theirs = ours(x), theirs(x)
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_ours, mlp(100)(x), rtol=1e-6, atol=1e-6)   # rank 0's weights, unsharded
    out_ours.square().sum().backward()
    out_theirs.square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad.to_local(), rtol=1e-5, atol=1e-6, msg=name)
    # src_data_rank=None: each rank shards its own weights (torch's meaning too)
    own = pynccl.tensor_parallel.parallelize_module(mlp(100 + rank), mesh, plan, src_data_rank=None)
    assert torch.equal(own[0].weight, mlp(100 + rank)[0].weight.chunk(ws)[rank])
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        pynccl.tensor_parallel.parallelize_module(mlp(0), init_device_mesh("cpu", (ws, 1)), plan)
    with pytest.raises(TypeError, match="is torch's _OwnStyle, which pynccl does not map"):
        pynccl.tensor_parallel.parallelize_module(mlp(0), mesh, {"0": _OwnStyle()})
    pynccl.barrier()   # rank 0 hosts the store: no rank leaves while another still makes mesh groups on it
    return True


class _OwnStyle(TorchParallelStyle):
    """A user's own torch style: its _apply works on DTensors, which pynccl has not."""

    def _apply(self, module, device_mesh):
        return module


def _torch_p2p_and_waits(rank, ws):
    peer = 1 - rank
    # torch's P2POp objects, op mapped by identity
    got = torch.zeros(3)
    works = pynccl.batch_isend_irecv([tdist.P2POp(tdist.isend, torch.full((3,), rank + 1.0), peer),
                                      tdist.P2POp(tdist.irecv, got, peer)])
    assert len(works) == 2 and all(w.wait(datetime.timedelta(seconds=30)) for w in works)   # gloo: one per op
    assert got.tolist() == [peer + 1.0] * 3
    with pytest.raises(ValueError, match="op must be pynccl.isend or pynccl.irecv"):
        pynccl.P2POp(tdist.send, got, peer)
    # barrier(async_op=True) returns without waiting for the others; wait() does
    if rank == 1:
        time.sleep(2.0)
    start = time.monotonic()
    work = pynccl.barrier(async_op=True)
    returned = time.monotonic() - start
    work.wait()
    waited = time.monotonic() - start
    if rank == 0:
        assert returned < 1.0 and waited > 1.0, (returned, waited)
    # Work.wait: torch's timedelta, its default timedelta(0), and seconds
    t = torch.ones(2)
    for timeout in (datetime.timedelta(seconds=20), datetime.timedelta(0), 20.0):
        assert pynccl.all_reduce(t, async_op=True).wait(timeout) is True
    assert t.tolist() == [8.0, 8.0]
    with pytest.raises(ValueError, match="timeout must be a datetime.timedelta"):
        pynccl.all_reduce(t, async_op=True).wait("1s")
    pynccl.barrier()
    # NON_GROUP_MEMBER handed to a wrapper: a clear error, not a silent skip
    ngm = pynccl.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match="NON_GROUP_MEMBER"):
            pynccl.DistributedDataParallel(nn.Linear(2, 2), process_group=ngm)
    return True


@pytest.mark.parametrize("case", [_fsdp_with_torch_options, _tp_plan_of_torch, _torch_p2p_and_waits],
                         ids=lambda c: c.__name__.strip("_"))
def test_torch_objects_on_gloo(case):
    assert run_multiprocess(case, 2, backend="gloo", timeout=300) == [True, True]


def _barriers_mixed_under_the_check(rank, ws):
    # torch lets one rank wait on barrier(async_op=True) while another calls barrier(): the same
    # collective, so the cross-rank signature check must see the same op.
    if rank == 0:
        pynccl.barrier(async_op=True).wait()
    else:
        pynccl.barrier()
    t = torch.ones(1)
    pynccl.all_reduce(t)
    return t.item() == ws


def test_async_and_blocking_barrier_are_one_collective_under_the_check():
    assert run_multiprocess(_barriers_mixed_under_the_check, 2, init_kwargs={"check_collectives": True},
                            timeout=120) == [True, True]
