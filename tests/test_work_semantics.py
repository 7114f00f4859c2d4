"""Work's torch semantics on gloo, against torch.distributed in the same ranks: is_completed() is True
only once the output is written (AVG's division and a reduce_scatter's copy-out run after gloo's own
work: a completed Work must hold its result, as torch's), and result() / is_success() / exception()
as torch's gloo Work (before completion, after success, after a failed op). The nccl Work's versions
are checked without a GPU (installed on pynccl._C.Work, errors naming what is missing).
"""
import datetime
import time
import types

import pytest
import torch
import torch.distributed as tdist

import pynccl
from pynccl import _ext
from pynccl.comm import work_future
from pynccl.comm.coalesced_ops import CoalescedWork
from pynccl.comm.groups import resolve_group
from pynccl.testing import run_multiprocess

AVG = tdist.ReduceOp.AVG


def _poll(work, seconds=30.0):
    """is_completed() until True, never wait(): what it says must hold on its own."""
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        assert time.monotonic() < deadline, f"{work!r} did not complete within {seconds} s"
        time.sleep(0.001)


def _ops(rank, ws):
    """(name, start(lib) -> (work, output)) of ops whose output is written after gloo's work."""
    data = torch.arange(4.0 * ws) + 10 * rank   # (ws*4,) per rank
    return [
        ("all_reduce AVG", lambda lib: _out(lambda t: lib.all_reduce(t, op=AVG, async_op=True), data.clone())),
        ("reduce AVG", lambda lib: _out(lambda t: lib.reduce(t, dst=0, op=AVG, async_op=True), data.clone())),
        ("reduce_scatter_tensor SUM", lambda lib: _out(
            lambda o: lib.reduce_scatter_tensor(o, data.clone(), async_op=True), torch.full((4,), -1.0))),
        ("reduce_scatter_tensor AVG", lambda lib: _out(
            lambda o: lib.reduce_scatter_tensor(o, data.clone(), op=AVG, async_op=True), torch.full((4,), -1.0))),
        ("reduce_scatter SUM", lambda lib: _out(
            lambda o: lib.reduce_scatter(o, list(data.clone().chunk(ws)), async_op=True), torch.full((4,), -1.0))),
    ]


def _out(start, output):
    return start(output), output


def _completed_holds_result(rank, ws):
    for name, start in _ops(rank, ws):
        if name.startswith("reduce_scatter "):   # torch's gloo has no list reduce_scatter: closed form
            expected = sum(torch.arange(4.0 * ws) + 10 * r for r in range(ws)).chunk(ws)[rank]
        else:
            work, expected = start(tdist)
            work.wait()
        for _ in range(5):   # gloo's thread and this one race differently each time
            work, output = start(pynccl)
            _poll(work)
            seen = output.clone()
            work.wait()
            if not name.startswith("reduce ") or rank == 0:   # reduce writes the root's output only
                assert torch.equal(seen, expected), f"{name}: is_completed() with {seen.tolist()}, " \
                                                    f"expected {expected.tolist()} (torch's)"
                assert torch.equal(output, expected), f"{name}: after wait() {output.tolist()}"
        pynccl.barrier()
    return True


def test_is_completed_means_output_written():
    assert run_multiprocess(_completed_holds_result, 2, timeout=60) == [True, True]


def _completed_with_future(rank, ws):
    """get_future()'s callback (gloo's thread), is_completed() and wait() race: AVG divides once."""
    expected = sum(torch.arange(6.0) + r for r in range(ws)) / ws
    for _ in range(20):
        t = torch.arange(6.0) + rank
        work = pynccl.all_reduce(t, op=AVG, async_op=True)
        fut = work.get_future()
        _poll(work)
        assert torch.equal(t, expected), f"is_completed() with {t.tolist()}, expected {expected.tolist()}"
        work.wait()
        assert torch.equal(fut.wait()[0], expected) and fut.wait()[0] is t
    return True


def test_is_completed_finishes_once_beside_future_and_wait():
    assert run_multiprocess(_completed_with_future, 2, timeout=60) == [True, True]


def _coalesced(rank, ws):
    """CoalescedWork (all_reduce_coalesced's): the results are in the caller's tensors once completed."""
    backend = resolve_group(None).backend
    tensors = [torch.arange(3.0) + rank, torch.full((2, 2), 2.0 * rank)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    work = CoalescedWork([backend.all_reduce(flat, pynccl.ReduceOp.AVG, True)], [flat], [tensors])
    _poll(work)
    expected = [sum(torch.arange(3.0) + r for r in range(ws)) / ws, torch.full((2, 2), float(ws - 1))]
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected)), f"is_completed() with {tensors}"
    assert work.is_success() and work.exception() is None and work.wait()
    return True


def test_coalesced_is_completed_means_copied_back():
    assert run_multiprocess(_coalesced, 2, timeout=60) == [True, True]


UNREADABLE = object()


def _exception(work):
    """work.exception(), or UNREADABLE where torch's binding cannot return it (torch 2.11's gloo Work:
    pybind11 "Unregistered type: std::exception_ptr"): that side's check is then skipped."""
    try:
        return work.exception()
    except TypeError as e:
        if "exception_ptr" not in str(e):
            raise
        return UNREADABLE


def _no_error(work) -> bool:
    return work.is_success() and _exception(work) in (None, UNREADABLE)


def _result_as_torch(rank, ws):
    store = pynccl.get_store()
    for lib in (tdist, pynccl):
        # before completion: rank 0 joins the all-reduce only after rank 1 has asked for the result
        t = torch.full((2,), rank + 1.0)
        if rank == 0:
            store.wait([f"asked/{lib.__name__}"])
            work = lib.all_reduce(t, async_op=True)
        else:
            work = lib.all_reduce(t, async_op=True)
            with pytest.raises(RuntimeError, match="wait()"):
                work.result()
            assert _no_error(work)   # torch's: no error yet
            store.set(f"asked/{lib.__name__}", "1")
        work.wait()
        assert work.is_completed() and _no_error(work)
        result = work.result()
        assert isinstance(result, list) and len(result) == 1 and result[0] is t
        assert torch.equal(t, torch.full((2,), 3.0))
        # ops with other outputs: result() is the output list, as torch's gloo gives it
        outs = [torch.zeros(2), torch.zeros(2)]
        work = lib.all_gather(outs, t, async_op=True)
        work.wait()
        assert [x.tolist() for x in work.result()] == [[3.0, 3.0], [3.0, 3.0]]
        work = lib.barrier(async_op=True)
        work.wait()
        assert work.result() == [] and _no_error(work)
    pynccl.barrier()
    return True


def test_result_is_success_exception_as_torch():
    assert run_multiprocess(_result_as_torch, 2, timeout=60) == [True, True]


def _failed_op(rank, ws):
    """An all-reduce rank 1 never joins fails on rank 0 (its group's 1 s timeout), as torch's."""
    timeout = datetime.timedelta(seconds=1)
    torch_group = tdist.new_group([0, 1], timeout=timeout)
    group = pynccl.new_group([0, 1], timeout=1.0)
    if rank == 0:
        for lib, g in ((tdist, torch_group), (pynccl, group)):
            work = lib.all_reduce(torch.ones(2), group=g, async_op=True)
            _poll(work)
            assert not work.is_success(), lib.__name__
            error = _exception(work)
            if error is UNREADABLE:
                continue
            assert error is not None, lib.__name__
            assert "timed out" in str(error).lower() or "timeout" in str(error).lower()
        assert isinstance(work.exception(), pynccl.CommTimeoutError)
        with pytest.raises(pynccl.CommTimeoutError):
            work.result()
        with pytest.raises(pynccl.CommTimeoutError):
            work.wait()
    pynccl.barrier()
    return True


def test_failed_op_as_torch():
    assert run_multiprocess(_failed_op, 2, timeout=60) == [True, True]


@pytest.mark.skipif(_ext._C is None, reason="pynccl._C is not built")
def test_nccl_work_has_result_and_names_what_it_lacks():
    """pynccl._C.Work (no GPU needed to check the class): result() as torch's WorkNCCL, the output
    tensors at once; is_success() and exception() raise NotImplementedError naming why, never
    AttributeError."""
    import pynccl.comm.distributed  # noqa: F401 - installs the methods
    assert _ext._C.Work.result is work_future.cuda_work_result
    assert _ext._C.Work.is_success is work_future.cuda_work_is_success
    assert _ext._C.Work.exception is work_future.cuda_work_exception

    class FakeWork:   # weak-referenceable, as the C++ Work is
        op, seq = "all_reduce", 3
    work, t = FakeWork(), torch.zeros(2)
    work_future.remember(work, [t])
    assert work_future.cuda_work_result(work) == [t]
    with pytest.raises(NotImplementedError, match=r"is_success.*all_reduce, seq 3.*synchronize\(\)"):
        work_future.cuda_work_is_success(work)
    with pytest.raises(NotImplementedError, match=r"exception.*all_reduce, seq 3.*synchronize\(\)"):
        work_future.cuda_work_exception(types.SimpleNamespace(op="all_reduce", seq=3))
