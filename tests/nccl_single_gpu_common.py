"""What the one-GPU NCCL tests share: a world-size-1 communicator (fixtures `comm`, `comm_p2p`),
deterministic inputs exact in every dtype, a calibrated GPU sleep, and run_every_op, which issues
each op once at world size 1. At world size 1 every reduction is the identity, except PREMUL_SUM,
which scales: that is what the expected values in the tests say."""
import os

import pytest
import torch

from pynccl import _ext
from pynccl.comm.reduce_op import ReduceOp

GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ext.available(), reason=f"pynccl._C not built: {_ext.import_error()!r}"),
]

C = _ext._C
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]
HAS_FP8 = bool(FP8) and _ext.available() and \
    _ext.nccl_version().runtime >= (2, 24, 0) and _ext.nccl_version().build >= (2, 24, 0)
DTYPES = FLOATS + INTS + (FP8 if HAS_FP8 else [])


# ----------------------------------------------------------------------------- helpers
def make(dtype, n=37, offset=0, shape=None):
    """Deterministic values 1..7 (exact in every dtype, fp8 included)."""
    x = ((torch.arange(n, device="cuda") + offset) % 7 + 1).float()
    return x.to(dtype).reshape(shape if shape is not None else (n,))


def same(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    if actual.dtype in FP8:  # compare fp8 bit patterns
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    assert torch.equal(actual, expected), (actual, expected)


def scaled(x, factor):
    return (x.double() * factor).to(x.dtype) if x.dtype == torch.float64 else (x.float() * factor).to(x.dtype)


_CYCLES_PER_S = []


def gpu_sleep(seconds):
    """Keep the current stream busy for about `seconds` (torch.cuda._sleep, calibrated once)."""
    if not _CYCLES_PER_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_S.append(50_000_000 / (start.elapsed_time(end) / 1e3))
    torch.cuda._sleep(int(seconds * _CYCLES_PER_S[0]))


INIT_TIMEOUT_S = 60.0


def new_comm(name, timeout_s=60.0, on_timeout=None, **env):
    """A fresh world-size-1 communicator, made as init_process_group makes one (blocking, a
    time-out ends the process) unless on_timeout="raise"; `env` sets PYNCCL_* variables.
    Its init is bounded by INIT_TIMEOUT_S and only then does `timeout_s` bound its ops: the first
    NCCL init of a process loads NCCL and builds its topology (seen taking over 0.5 s on 2xH100),
    so a sub-second op timeout would time out the init instead of the op under test."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        comm = C.Communicator(C.get_unique_id(), 1, 0, 0, timeout_s=max(timeout_s, INIT_TIMEOUT_S), name=name,
                              on_timeout=on_timeout)
        comm.timeout_s = timeout_s
        return comm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def comm():
    c = new_comm("single", timeout_s=120.0)
    yield c
    if not c.is_aborted():
        c.destroy()


@pytest.fixture(scope="module")
def comm_p2p():
    """Forces the grouped send/recv paths of all_to_all_single/gather/scatter."""
    c = new_comm("single_p2p", timeout_s=120.0, PYNCCL_NATIVE_ALLTOALL=0)
    yield c
    c.destroy()


def run_every_op(comm, x, check):
    """Each op on x at world size 1; `check(name, actual, expected)` after a sync."""
    n, dtype = x.numel(), x.dtype
    is_float = dtype in FLOATS
    results = []
    reduce_ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN] + ([] if dtype in FP8 else [ReduceOp.PRODUCT])
    for op in reduce_ops:
        y = x.clone()
        assert comm.all_reduce(y, op) is None
        results.append((f"all_reduce {op.name}", y, x))
    if is_float:
        y = x.clone()
        comm.all_reduce(y, ReduceOp.AVG)
        results.append(("all_reduce AVG", y, x))
        y = x.clone()
        comm.all_reduce(y, ReduceOp.premul_sum(0.5))
        results.append(("all_reduce premul_sum object", y, scaled(x, 0.5)))
        y = x.clone()
        comm.all_reduce(y, int(ReduceOp.PREMUL_SUM), False, 0.25)
        results.append(("all_reduce PREMUL_SUM int + factor", y, scaled(x, 0.25)))
    y = x.clone()
    comm.broadcast(y, 0)
    results.append(("broadcast", y, x))
    y = x.clone()
    comm.reduce(y, 0, ReduceOp.SUM)
    results.append(("reduce", y, x))
    if is_float:
        y = x.clone()
        comm.reduce(y, 0, ReduceOp.premul_sum(0.5))
        results.append(("reduce premul", y, scaled(x, 0.5)))
    outs = [torch.empty_like(x)]
    comm.all_gather(outs, x)
    results.append(("all_gather", outs[0], x))
    out = torch.empty_like(x)
    comm.all_gather_into_tensor(out, x)
    results.append(("all_gather_into_tensor", out, x))
    buf = x.clone()
    comm.all_gather_into_tensor(buf, buf[0:n])  # in place: input is this rank's chunk of output
    results.append(("all_gather_into_tensor in-place", buf, x))
    out = torch.empty_like(x)
    comm.reduce_scatter(out, [x], ReduceOp.SUM)
    results.append(("reduce_scatter", out, x))
    out = torch.empty_like(x)
    comm.reduce_scatter_tensor(out, x, ReduceOp.SUM)
    results.append(("reduce_scatter_tensor", out, x))
    buf = x.clone()
    comm.reduce_scatter_tensor(buf[0:n], buf, ReduceOp.SUM)
    results.append(("reduce_scatter_tensor in-place", buf, x))
    if is_float:
        out = torch.empty_like(x)
        comm.reduce_scatter(out, [x], ReduceOp.premul_sum(0.5))
        results.append(("reduce_scatter premul", out, scaled(x, 0.5)))
        out = torch.empty_like(x)
        comm.reduce_scatter_tensor(out, x, ReduceOp.premul_sum(0.5))
        results.append(("reduce_scatter_tensor premul", out, scaled(x, 0.5)))
    outs = [torch.empty_like(x)]
    comm.all_to_all(outs, [x])
    results.append(("all_to_all", outs[0], x))
    x2 = x.reshape(n, 1).expand(n, 3).contiguous()
    out = torch.empty_like(x2)
    comm.all_to_all_single(out, x2, None, None)
    results.append(("all_to_all_single equal", out, x2))
    out = torch.empty_like(x2)
    comm.all_to_all_single(out, x2, [n], [n])
    results.append(("all_to_all_single splits", out, x2))
    outs = [torch.empty_like(x)]
    comm.gather(x, outs, 0)
    results.append(("gather", outs[0], x))
    out = torch.empty_like(x)
    comm.scatter(out, [x], 0)
    results.append(("scatter", out, x))
    y = torch.empty_like(x)
    work = comm.batch_isend_irecv([(True, x, 0), (False, y, 0)])
    assert work.wait() is True
    results.append(("batch_isend_irecv (self send + recv)", y, x))
    torch.cuda.synchronize()
    for name, actual, expected in results:
        check(name, actual, expected)

