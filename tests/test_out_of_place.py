"""The backends' `output=` (out-of-place all_reduce / reduce / broadcast) on gloo: values against a
closed-form reference, the input left untouched, root-only writes for reduce, and the errors.
One launch per world size."""
import pytest
import torch

import pynccl
from pynccl.testing import run_multiprocess

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8]


def _data(rank, n, dtype):
    return (torch.arange(n) + rank).to(dtype)


def _checks(rank, ws):
    be = pynccl.get_default_group().backend
    n = 6
    total = lambda dtype: sum(_data(r, n, torch.float64) for r in range(ws)).to(dtype)  # noqa: E731
    for dtype in DTYPES:
        x = _data(rank, n, dtype)
        out = torch.full((n,), 77, dtype=dtype)
        assert be.all_reduce(x, pynccl.ReduceOp.SUM, False, output=out) is None
        assert torch.equal(out, total(dtype)), (dtype, out)
        assert torch.equal(x, _data(rank, n, dtype)), "all_reduce modified its input"
        # reduce: root 0 gets the sum; other ranks' outputs are not written.
        out = torch.full((n,), 77, dtype=dtype)
        be.reduce(x, 0, pynccl.ReduceOp.MAX, False, output=out)
        expected = _data(ws - 1, n, dtype) if rank == 0 else torch.full((n,), 77, dtype=dtype)
        assert torch.equal(out, expected), (dtype, rank, out)
        assert torch.equal(x, _data(rank, n, dtype)), "reduce modified its input"
        # broadcast: root's input lands in every rank's output.
        root = ws - 1
        out = torch.zeros(n, dtype=dtype)
        be.broadcast(x, root, False, output=out)
        assert torch.equal(out, _data(root, n, dtype)), (dtype, out)
        assert torch.equal(x, _data(rank, n, dtype)), "broadcast modified its input"
    # AVG, async, and a differently shaped output with the same numel.
    x = _data(rank, 6, torch.float32).view(2, 3)
    out = torch.empty(6)
    work = be.all_reduce(x, pynccl.ReduceOp.AVG, True, output=out)
    work.wait()
    # Integers (exact) averaged: at most ws + 1 roundings of the result's size (ws·eps relative).
    expected = total(torch.float32) / ws
    assert ((out - expected).abs() <= ws * torch.finfo(torch.float32).eps * expected.abs()).all(), out
    # Errors name what was expected and what was given; the output is not written.
    x = torch.ones(4)
    errors = []
    for bad, exc in ((torch.ones(4, dtype=torch.float64), TypeError), (torch.ones(5), ValueError),
                     ([1.0] * 4, TypeError), (torch.ones(8)[::2], ValueError)):
        for call in (lambda o: be.all_reduce(x, pynccl.ReduceOp.SUM, False, output=o),
                     lambda o: be.reduce(x, 0, pynccl.ReduceOp.SUM, False, output=o),
                     lambda o: be.broadcast(x, 0, False, output=o)):
            with pytest.raises(exc) as info:
                call(bad)
            errors.append(str(info.value))
    assert "float64" in errors[0] and "float32" in errors[0], errors[0]
    assert "5 elements" in errors[3] and "expected 4" in errors[3], errors[3]
    assert "list" in errors[6], errors[6]
    return True


@pytest.mark.parametrize("ws", [1, 2])
def test_out_of_place_gloo(ws):
    assert run_multiprocess(_checks, ws, backend="gloo") == [True] * ws


# ----------------------------------------------------------------------------- nccl, one GPU
from pynccl import _ext  # noqa: E402


def gpu_test(fn):
    """Marks a test that needs one GPU and the built extension (skipped, with the reason, otherwise)."""
    fn = pytest.mark.skipif(not _ext.available(), reason="pynccl._C not built")(fn)
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)


GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64,
              torch.int8, torch.uint8, torch.int32, torch.int64]


@pytest.fixture(scope="module")
def comm():
    c = _ext._C.Communicator(_ext._C.get_unique_id(), 1, 0, 0, timeout_s=60.0, name="out_of_place")
    yield c
    c.destroy()


def _make(dtype, n=37, offset=0):
    return ((torch.arange(n, device="cuda") + offset) % 7 + 1).to(dtype)


@gpu_test
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_nccl_out_of_place_values(comm, dtype):
    R = pynccl.ReduceOp
    x = _make(dtype)
    ops = [(R.SUM, x), (R.MAX, x)] + ([(R.premul_sum(0.5), (x.double() * 0.5).to(dtype)), (R.AVG, x)]
                                      if dtype.is_floating_point else [])
    for op, expected in ops:
        out = torch.full_like(x, 3)
        assert comm.all_reduce(x, op, False, output=out) is None
        assert torch.equal(out, expected), (op, out, expected)
        out = torch.full_like(x, 3)
        comm.reduce(x, 0, op, output=out)
        assert torch.equal(out, expected), (op, out, expected)
    out = torch.zeros(x.shape[0], 1, dtype=dtype, device="cuda")  # another shape, same numel
    comm.broadcast(x, 0, output=out)
    assert torch.equal(out.view(-1), x)
    out = torch.zeros_like(x)
    comm.all_reduce(x, R.SUM, True, output=out).wait()
    assert torch.equal(out, x)
    assert torch.equal(x, _make(dtype)), "an out-of-place op wrote its input"
    same = x.clone()  # output= the input itself is the in-place op
    comm.all_reduce(same, R.premul_sum(2.0) if dtype.is_floating_point else R.SUM, output=same)
    torch.cuda.synchronize()


@gpu_test
def test_nccl_out_of_place_in_a_cuda_graph(comm):
    src = _make(torch.float32, 64)
    out = {k: torch.zeros(64, device="cuda") for k in ("ar", "bc", "red")}

    def run():
        comm.all_reduce(src, pynccl.ReduceOp.premul_sum(0.5), output=out["ar"])
        comm.broadcast(src, 0, output=out["bc"])
        comm.reduce(src, 0, pynccl.ReduceOp.SUM, output=out["red"])

    run()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        run()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    for offset in (3, 5):
        src.copy_(_make(torch.float32, 64, offset))
        for v in out.values():
            v.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["ar"], src * 0.5) and torch.equal(out["bc"], src) and torch.equal(out["red"], src)
    del graph


@gpu_test
def test_nccl_out_of_place_errors(comm):
    x = torch.ones(8, device="cuda")
    cases = [(torch.ones(8, device="cuda", dtype=torch.float64), TypeError, "dtype"),
             (torch.ones(9, device="cuda"), ValueError, "9 elements, expected 8"),
             (torch.ones(16, device="cuda")[::2], ValueError, "contiguous"),
             (torch.ones(8), ValueError, "CUDA tensor"),
             ([1.0] * 8, TypeError, "torch.Tensor or None, got list")]
    buf = torch.ones(12, device="cuda")
    cases.append((buf[4:12], ValueError, "partially overlaps"))
    for bad, exc, text in cases:
        src = buf[0:8] if text == "partially overlaps" else x
        for call in (lambda: comm.all_reduce(src, 0, output=bad), lambda: comm.reduce(src, 0, 0, output=bad),
                     lambda: comm.broadcast(src, 0, output=bad)):
            with pytest.raises(exc, match=text):
                call()
    assert not comm.is_aborted()
