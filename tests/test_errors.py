"""Bad input gets a clear exception naming what was expected, never a crash or a hang.
The gloo cases run in one 2-process run; the same checks on NCCL are in test_nccl_inputs_buckets.py."""
import pytest
import torch
import torch.distributed

import pynccl
from pynccl.testing import run_multiprocess


def test_any_op_before_init_raises():
    assert not pynccl.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        pynccl.all_reduce(torch.ones(1))
    with pytest.raises(RuntimeError, match="not initialized"):
        pynccl.broadcast(torch.ones(1), src=0)
    with pytest.raises(RuntimeError, match="not initialized"):
        pynccl.get_rank()
    with pytest.raises(RuntimeError, match="not initialized"):
        pynccl.new_group([0])


def test_init_argument_errors(monkeypatch):
    with pytest.raises(ValueError, match="backend must be 'nccl', 'gloo', torch's 'cpu:gloo,cuda:nccl' form or None, "
                                         "got 'mpi'"):
        pynccl.init_process_group(backend="mpi")
    with pytest.raises(ValueError, match="pynccl runs cpu:gloo and cuda:nccl, not cpu:mpi"):
        pynccl.init_process_group(backend="cpu:mpi,cuda:nccl")
    with pytest.raises(TypeError, match="backend must be a str"):
        pynccl.init_process_group(backend=3)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        pynccl.init_process_group(backend="gloo")
    with pytest.raises(ValueError, match=r"rank 5 out of range \[0, world_size=2\)"):
        pynccl.init_process_group(backend="gloo", rank=5, world_size=2)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        pynccl.init_process_group(backend="gloo", rank=0, world_size=1, timeout=-1)
    assert not pynccl.is_initialized()


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def bad_input_case(rank, ws):
    f32 = torch.ones(4)
    # A tensor on another device than the group's (CUDA on a CPU machine is not available,
    # the meta device stands in for "not the group's device").
    _raises(ValueError, "expected a CPU tensor for the gloo backend, got a tensor on meta",
            pynccl.all_reduce, torch.ones(4, device="meta"))
    if torch.cuda.is_available():
        _raises(ValueError, "expected a CPU tensor", pynccl.all_reduce, torch.ones(4, device="cuda"))
    _raises(TypeError, "must be a torch.Tensor, got list", pynccl.broadcast, [1, 2], src=0)
    # dtype mismatches
    _raises(TypeError, r"output has dtype torch.float64, expected input's dtype torch.float32",
            pynccl.all_gather_into_tensor, torch.zeros(8, dtype=torch.float64), f32)
    _raises(TypeError, r"tensor_list\[1\] has dtype torch.int32",
            pynccl.all_gather, [torch.zeros(4), torch.zeros(4, dtype=torch.int32)], f32)
    # size mismatches
    _raises(ValueError, r"all_gather_into_tensor: output has 6 elements, expected world_size\(2\) × input\(4\) = 8",
            pynccl.all_gather_into_tensor, torch.zeros(6), f32)
    _raises(ValueError, r"reduce_scatter_tensor: input has 4 elements, expected world_size\(2\) × output\(4\) = 8",
            pynccl.reduce_scatter_tensor, torch.zeros(4), f32)
    _raises(ValueError, r"tensor_list has 3 tensors, expected world_size\(2\)",
            pynccl.all_gather, [torch.zeros(4)] * 3, f32)
    _raises(ValueError, r"input_split_sizes sum to 5, expected input.shape\[0\] \(4\)",
            pynccl.all_to_all_single, torch.zeros(4), f32, None, [2, 3])
    # ranks out of range
    _raises(ValueError, r"src=2 is not a rank of group 'world'", pynccl.broadcast, f32, src=2)
    _raises(ValueError, r"dst=-1 is not a rank of group 'world'", pynccl.reduce, f32, dst=-1)
    _raises(ValueError, r"dst=7 is not a rank", pynccl.send, f32, dst=7)
    _raises(ValueError, r"src=3 is not a rank", pynccl.recv, f32, src=3)
    _raises(ValueError, r"new_group: rank 4 out of range", pynccl.new_group, [0, 4])
    # reduce op the dtype cannot take
    _raises(ValueError, r"ReduceOp.AVG needs a floating-point tensor, got torch.int32",
            pynccl.all_reduce, torch.ones(2, dtype=torch.int32), op=pynccl.ReduceOp.AVG)
    _raises(ValueError, r"ReduceOp.PREMUL_SUM needs a floating-point tensor",
            pynccl.all_reduce, torch.ones(2, dtype=torch.int64), op=pynccl.ReduceOp.premul_sum(2.0))
    _raises(TypeError, r"all_reduce: op must be a pynccl.ReduceOp, a torch.distributed.ReduceOp", pynccl.all_reduce,
            f32, op=17)
    _raises(TypeError, r"reduce: op must be a pynccl.ReduceOp", pynccl.reduce, f32, 0, op=4)  # torch refuses ints too
    _raises(ValueError, r"ReduceOp.BAND needs an integer or bool tensor", pynccl.all_reduce, f32,
            op=torch.distributed.ReduceOp.BAND)
    # unsupported dtype and non-contiguous input
    _raises(TypeError, r"dtype torch.complex64 is not supported",
            pynccl.all_reduce, torch.ones(2, dtype=torch.complex64))
    _raises(ValueError, r"expected a contiguous tensor", pynccl.all_reduce, torch.ones(4, 4).t())
    _raises(TypeError, r"group must be a pynccl ProcessGroup", pynccl.all_reduce, f32, group="world")
    # batch_isend_irecv: wrong element, non-tensor, unknown peer, mixed groups
    _raises(TypeError, r"element 1 is str, expected pynccl.P2POp",
            pynccl.batch_isend_irecv, [pynccl.P2POp(pynccl.isend, f32, 1 - rank), "x"])
    _raises(TypeError, r"ops\[0\].tensor must be a torch.Tensor, got list",
            pynccl.batch_isend_irecv, [pynccl.P2POp(pynccl.isend, [1.0], 1 - rank)])
    _raises(ValueError, r"peer=5 is not a rank of group 'world'",
            pynccl.batch_isend_irecv, [pynccl.P2POp(pynccl.isend, f32, 5)])
    _raises(ValueError, r"batch_isend_irecv: expected a non-empty list", pynccl.batch_isend_irecv, [])
    # Nothing above reached the communicator: a real op still works and agrees.
    t = torch.full((2,), float(rank))
    pynccl.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    # use of a destroyed group
    g = pynccl.new_group([0, 1])
    pynccl.destroy_process_group(g)
    _raises(RuntimeError, r"process group 'group\d+' was destroyed", pynccl.all_reduce, f32, group=g)
    _raises(RuntimeError, "already initialized", pynccl.init_process_group, backend="gloo")
    return "ok"


def test_bad_input_errors_gloo():
    assert run_multiprocess(bad_input_case, 2) == ["ok", "ok"]


def after_destroy_case(rank, ws):
    pynccl.destroy_process_group()
    with pytest.raises(RuntimeError, match="not initialized"):
        pynccl.all_reduce(torch.ones(1))
    return "ok"


def test_use_after_destroy_gloo():
    assert run_multiprocess(after_destroy_case, 2) == ["ok", "ok"]


def bootstrap_from_torch_case(rank, ws):
    import torch.distributed as tdist
    tdist.init_process_group("gloo")
    pynccl.init_process_group(backend="gloo")
    assert pynccl.get_rank() == tdist.get_rank() and pynccl.get_world_size() == ws
    t = torch.tensor([rank + 1.0])
    pynccl.all_reduce(t)
    assert t.item() == sum(range(1, ws + 1))
    pynccl.destroy_process_group()
    assert tdist.is_initialized(), "pynccl must not tear down a torch.distributed group it did not create"
    tdist.destroy_process_group()
    return "ok"


def test_bootstrap_from_initialized_torch_distributed():
    assert run_multiprocess(bootstrap_from_torch_case, 3, backend=None) == ["ok"] * 3
