"""Every NCCL op at world size 1 on one GPU: every dtype with closed-form results, async Work
and its stream order, and CUDA graph capture and replay."""
import time

import pytest
import torch

from pynccl.comm.backends.base import Work as BaseWork
from pynccl.errors import PyncclError
from pynccl.comm.reduce_op import ReduceOp
from nccl_single_gpu_common import (GPU_MARKS, C, DTYPES, FP8, HAS_FP8, comm, comm_p2p, gpu_sleep,  # noqa: F401 (fixtures)
                                    make, new_comm, run_every_op, same, scaled)

pytestmark = GPU_MARKS

# ----------------------------------------------------------------------------- every op
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_op_every_dtype(comm, dtype):
    def check(name, actual, expected):
        try:
            same(actual, expected)
        except AssertionError as e:
            raise AssertionError(f"{name} {dtype}: {e}") from None

    run_every_op(comm, make(dtype), check)


def test_fp8_gated_on_runtime_version(comm):
    if not FP8:
        pytest.skip("this torch has no float8 dtypes")
    x = torch.ones(8, device="cuda").to(FP8[0])
    if HAS_FP8:
        comm.all_reduce(x, ReduceOp.SUM)
    else:
        with pytest.raises(TypeError, match="2.24"):
            comm.all_reduce(x, ReduceOp.SUM)


def test_grouped_p2p_fallbacks(comm_p2p):
    def check(name, actual, expected):
        same(actual, expected)

    run_every_op(comm_p2p, make(torch.float32, 40), check)


def test_complex_and_bool(comm):
    z = torch.randn(16, dtype=torch.complex64, device="cuda")
    y = z.clone()
    comm.all_reduce(y, ReduceOp.SUM)
    comm.all_reduce(y, ReduceOp.AVG)
    assert torch.equal(y, z)
    comm.all_reduce(y, ReduceOp.premul_sum(0.5))
    assert torch.equal(y, z * 0.5)
    with pytest.raises(ValueError, match="not defined for complex"):
        comm.all_reduce(y, ReduceOp.MAX)
    b = torch.tensor([True, False, True], device="cuda")
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX):
        c = b.clone()
        comm.all_reduce(c, op)
        assert torch.equal(c, b)


def test_zero_element_tensors(comm):
    """Zero-element tensors (an empty bucket, a rank with no rows of a shard) are valid input for
    every op, as in torch.distributed: each is a sequenced op that completes (flight record
    "completed", count 0), leaves its tensors empty, and the communicator stays usable."""
    empty = lambda: torch.empty(0, device="cuda")          # noqa: E731
    x = empty()
    ops = [("all_reduce", lambda: comm.all_reduce(x, ReduceOp.SUM)),
           ("broadcast", lambda: comm.broadcast(x, 0)),
           ("reduce", lambda: comm.reduce(x, 0, ReduceOp.SUM)),
           ("all_gather_into_tensor", lambda: comm.all_gather_into_tensor(empty(), x)),
           ("reduce_scatter_tensor", lambda: comm.reduce_scatter_tensor(empty(), x, ReduceOp.SUM)),
           ("all_to_all_single", lambda: comm.all_to_all_single(empty(), x, None, None))]
    first_seq = comm.seq
    for name, call in ops:
        assert call() is None, name
    work = comm.all_reduce(x, ReduceOp.SUM, True)                       # async: a Work that completes
    assert work.wait() is True and work.synchronize() is True and work.is_completed()
    torch.cuda.synchronize()
    assert comm.seq == first_seq + len(ops) + 1, "each empty op takes one sequence number"
    assert x.numel() == 0
    time.sleep(0.35)                                                    # the watchdog marks them completed
    record = [e for e in comm.flight_record() if e["seq"] >= first_seq]
    assert [e["op"] for e in record] == [name for name, _ in ops] + ["all_reduce"], record
    assert all(e["count"] == 0 and e["state"] in ("completed", "untracked") for e in record), record
    y = make(torch.float32)                                             # still usable: the same results
    expected = y.clone()
    comm.all_reduce(y, ReduceOp.SUM)
    torch.cuda.synchronize()
    same(y, expected)


# ----------------------------------------------------------------------------- async Work
def test_async_ops_return_work_and_order_streams(comm):
    x = make(torch.float32, 1 << 16)
    out = torch.zeros_like(x)
    gpu_sleep(0.2)
    src = x * 3  # queued on the current stream behind the sleep
    work = comm.all_gather_into_tensor(out, src, async_op=True)
    assert isinstance(work, C.Work) and isinstance(work, BaseWork)
    assert work.op == "all_gather_into_tensor" and work.seq == comm.seq - 1
    assert not work.is_completed()  # the comm stream waits for the sleeping current stream
    assert work.wait() is True      # no host block: returns at once
    seen = out.clone()              # ordered after the op by wait()
    assert work.synchronize() is True and work.is_completed()
    torch.cuda.synchronize()
    assert torch.equal(seen, x * 3)


@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                                  "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                                  "gather", "scatter"])
def test_every_op_async(comm, name):
    x = make(torch.float32, 64)
    out = torch.zeros_like(x)
    outs = [torch.zeros_like(x)]
    calls = {
        "all_reduce": lambda: comm.all_reduce(out.copy_(x), ReduceOp.premul_sum(0.5), True),
        "broadcast": lambda: comm.broadcast(out.copy_(x), 0, True),
        "reduce": lambda: comm.reduce(out.copy_(x), 0, ReduceOp.SUM, True),
        "all_gather": lambda: comm.all_gather(outs, x, True),
        "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(out, x, True),
        "reduce_scatter": lambda: comm.reduce_scatter(out, [x], ReduceOp.SUM, True),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(out, x, ReduceOp.SUM, True),
        "all_to_all": lambda: comm.all_to_all(outs, [x], True),
        "all_to_all_single": lambda: comm.all_to_all_single(out, x, None, None, True),
        "gather": lambda: comm.gather(x, outs, 0, True),
        "scatter": lambda: comm.scatter(out, [x], 0, True),
    }
    work = calls[name]()
    assert isinstance(work, C.Work)
    work.wait()
    torch.cuda.synchronize()
    assert work.is_completed()
    result = outs[0] if name in ("all_gather", "all_to_all", "gather") else out
    same(result, scaled(x, 0.5) if name == "all_reduce" else x)


def test_dropped_work_keeps_tensors_alive_until_done(comm):
    torch.cuda.synchronize()
    big = torch.ones(16 << 20, device="cuda")  # 64 MiB
    held = torch.cuda.memory_allocated()
    gpu_sleep(0.3)
    work = comm.all_reduce(big, ReduceOp.SUM, True)
    del big, work  # the op has not run yet: its tensor must stay allocated
    assert torch.cuda.memory_allocated() == held
    torch.cuda.synchronize()
    time.sleep(0.5)  # the watchdog (100 ms poll) sees the completion
    comm.all_reduce(torch.ones(1, device="cuda"))  # the next op releases what the watchdog retired
    assert torch.cuda.memory_allocated() <= held - (64 << 20) + 4096


# ----------------------------------------------------------------------------- CUDA graphs
def test_graph_capture_and_replay_of_every_op():
    # NOTE: a 1 ms watchdog poll and an op left pending behind a sleep make the watchdog query
    # events while the capture runs: that must not invalidate a global-mode capture.
    comm = new_comm("graph", timeout_s=60.0, PYNCCL_WATCHDOG_POLL_MS=1)
    n = 96
    src = make(torch.float32, n)
    out = {k: torch.zeros(n, device="cuda") for k in
           ("ar", "bc", "red", "ag", "agit", "rs", "rst", "a2a", "a2as", "a2asp", "ga", "sc", "p2p", "async",
            "u1", "u2")}
    flat = torch.zeros(n, dtype=torch.bfloat16, device="cuda")

    def run():
        out["ar"].copy_(src)
        comm.all_reduce(out["ar"], ReduceOp.premul_sum(0.5))
        out["bc"].copy_(src)
        comm.broadcast(out["bc"], 0)
        out["red"].copy_(src)
        comm.reduce(out["red"], 0, ReduceOp.SUM)
        comm.all_gather([out["ag"]], src)
        comm.all_gather_into_tensor(out["agit"], src)
        comm.reduce_scatter(out["rs"], [src], ReduceOp.premul_sum(0.25))
        comm.reduce_scatter_tensor(out["rst"], src, ReduceOp.SUM)
        comm.all_to_all([out["a2a"]], [src])
        comm.all_to_all_single(out["a2as"], src, None, None)
        comm.all_to_all_single(out["a2asp"], src, [n], [n])
        comm.gather(src, [out["ga"]], 0)
        comm.scatter(out["sc"], [src], 0)
        comm.batch_isend_irecv([(True, src, 0), (False, out["p2p"], 0)]).wait()
        comm.all_gather_into_tensor(out["async"], src, async_op=True).wait()
        C.pack([src[:10], src[10:]], flat, 0.5)
        C.unpack(flat, [out["u1"][:10], out["u1"][10:]], 2.0)
        C.unpack(flat, [out["u2"]], 1.0)

    def check():
        torch.cuda.synchronize()
        half = (src * 0.5).to(torch.bfloat16)
        expected = {"ar": src * 0.5, "rs": src * 0.25, "u1": half.float() * 2.0, "u2": half.float()}
        for k, v in out.items():
            assert torch.equal(v, expected.get(k, src)), k

    run()  # eager warm-up: NCCL sets up lazily on first use
    check()
    gpu_sleep(0.5)
    comm.all_reduce(torch.ones(1, device="cuda"))  # tracked op pending during the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    seq_before = comm.seq
    with torch.cuda.stream(stream):
        graph.capture_begin()
        run()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    assert any(e["state"] == "captured" for e in comm.flight_record())
    for offset in (3, 5):
        src.copy_(make(torch.float32, n, offset=offset))
        for v in out.values():
            v.zero_()
        graph.replay()
        check()
    assert comm.seq > seq_before and not comm.is_aborted()
    comm.check()
    del graph
    comm.destroy()


def test_barrier_refuses_graph_capture(comm):
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(PyncclError, match="capturing"):
                comm.barrier()
        finally:
            graph.capture_end()
