"""One-GPU NCCL timeouts (watchdog, barrier, Work.synchronize, an unmatched self-recv) that
abort the communicator, abort/destroy, split, the Python backend binding and the flight record."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from pynccl.errors import CommTimeoutError, PyncclError
from pynccl.comm.reduce_op import ReduceOp
from nccl_single_gpu_common import _CYCLES_PER_S, GPU_MARKS, C, gpu_sleep, new_comm, comm  # noqa: F401 (fixtures)

pytestmark = GPU_MARKS

# ----------------------------------------------------------------------------- timeouts
_TEARDOWN = """
import sys, torch
from pynccl import _ext
C = _ext._C
comm = C.Communicator(C.get_unique_id(), 1, 0, 0, timeout_s=1.0, name="td")
print("POLICY", comm.blocking, comm.on_timeout, flush=True)
t = torch.ones(4, device="cuda")
comm.all_reduce(t)
torch.cuda.synchronize()
torch.cuda._sleep(int(sys.argv[1]))
comm.all_reduce(t)  # stuck behind the sleep past the 1 s timeout
torch.cuda.synchronize()
print("CONSUMED", t.sum().item(), flush=True)
"""


def test_default_timeout_ends_the_process(tmp_path):
    gpu_sleep(0.01)  # calibrates _CYCLES_PER_S
    env = dict(os.environ, PYNCCL_FLIGHT_RECORDER_DIR=str(tmp_path))
    env.pop("PYNCCL_ON_TIMEOUT", None)
    env.pop("PYNCCL_NCCL_NONBLOCKING", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _TEARDOWN, str(int(20.0 * _CYCLES_PER_S[0]))], capture_output=True,
                          text=True, timeout=90, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode == 75, (proc.returncode, proc.stdout, proc.stderr)
    assert "POLICY True teardown" in proc.stdout and "CONSUMED" not in proc.stdout, proc.stdout
    assert re.search(r"pynccl: communicator 'td' .*all_reduce \(seq 1\) did not complete within 1 s", proc.stderr), \
        proc.stderr
    path = re.search(r"Flight record: (\S+\.json)", proc.stderr).group(1)
    states = {e["seq"]: e["state"] for e in json.load(open(path))["entries"]}
    assert states == {0: "completed", 1: "timed_out"}
    assert elapsed < 15.0, elapsed  # before the 20 s sleep ended: the process did not wait for the op


def test_watchdog_times_out_a_sync_op_and_aborts(tmp_path, monkeypatch):
    monkeypatch.setenv("PYNCCL_FLIGHT_RECORDER_DIR", str(tmp_path))
    comm = new_comm("wd", timeout_s=0.5, on_timeout="raise", PYNCCL_WATCHDOG_POLL_MS=20)
    t = torch.ones(4, device="cuda")
    comm.all_reduce(t)  # completes: recorded as "completed"
    torch.cuda.synchronize()
    gpu_sleep(4.0)
    comm.all_reduce(t)  # stuck behind the sleep past the 0.5 s timeout
    start = time.monotonic()
    while not comm.is_aborted() and time.monotonic() - start < 3.0:
        time.sleep(0.02)
    assert comm.is_aborted(), "the watchdog did not abort the communicator"
    assert time.monotonic() - start < 2.5
    with pytest.raises(CommTimeoutError) as info:
        comm.all_reduce(t)
    message = str(info.value)
    assert re.search(r"all_reduce \(seq 1\) did not complete within 0\.5 s", message), message
    assert "'wd'" in message
    path = re.search(r"Flight record: (\S+\.json)", message).group(1)
    record = json.load(open(path))
    assert record["group"] == "wd" and record["rank"] == 0
    states = {e["seq"]: e["state"] for e in record["entries"]}
    assert states == {0: "completed", 1: "timed_out"}
    assert comm.get_async_error() is not None
    with pytest.raises(CommTimeoutError):
        comm.check()
    torch.cuda.synchronize()
    comm.destroy()
    with pytest.raises(PyncclError, match="was destroyed"):
        comm.all_reduce(t)


def test_barrier_timeout_raises_and_aborts(tmp_path, monkeypatch):
    monkeypatch.setenv("PYNCCL_FLIGHT_RECORDER_DIR", str(tmp_path))
    comm = new_comm("bar", timeout_s=0.3, on_timeout="raise")
    comm.barrier()
    gpu_sleep(3.0)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"barrier \(seq \d+\) did not complete within 0\.3 s"):
        comm.barrier()
    # NOTE: ncclCommAbort may wait for the device (cudaFree), so the raise can come as late as
    # the sleep's end; what matters is that it comes, bounded.
    assert time.monotonic() - start < 6.0
    assert comm.is_aborted()
    torch.cuda.synchronize()


def test_work_synchronize_timeout_raises_and_aborts(tmp_path, monkeypatch):
    monkeypatch.setenv("PYNCCL_FLIGHT_RECORDER_DIR", str(tmp_path))
    comm = new_comm("sync", timeout_s=30.0, on_timeout="raise")
    t = torch.ones(4, device="cuda")
    gpu_sleep(3.0)
    work = comm.all_reduce(t, ReduceOp.SUM, True)
    with pytest.raises(CommTimeoutError, match=r"all_reduce \(seq 0\) did not complete within 0\.2 s"):
        work.synchronize(timeout_s=0.2)
    assert comm.is_aborted()
    with pytest.raises(CommTimeoutError):
        work.wait()
    torch.cuda.synchronize()


_SELF_RECV = """
import os, sys, torch
from pynccl import _ext
from pynccl.errors import CommTimeoutError, PyncclError
C = _ext._C
comm = C.Communicator(C.get_unique_id(), 1, 0, 0, timeout_s=2.0, name="selfrecv", on_timeout=sys.argv[1])
t = torch.zeros(16, device="cuda")
try:
    comm.batch_isend_irecv([(False, t, 0)]).synchronize()
    print("COMPLETED", flush=True)
except ValueError as e:
    print("REFUSED", e, flush=True)
except CommTimeoutError as e:
    print("TIMEOUT", comm.is_aborted(), e, flush=True)
except PyncclError as e:
    print("ERROR", e, flush=True)
t2, t3 = torch.arange(16.0, device="cuda"), torch.zeros(16, device="cuda")
comm.batch_isend_irecv([(True, t2, 0), (False, t3, 0)]).synchronize()   # still usable: a paired one
print("PAIRED", torch.equal(t2, t3), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("on_timeout", ["raise", "teardown"])
def test_unmatched_self_recv_is_refused_in_a_subprocess(tmp_path, on_timeout):
    """A recv from this rank with no send to it in the batch: NCCL may wait forever or (seen at
    world size 1) complete it with nothing received. batch_isend_irecv refuses it before NCCL sees
    it, in both time-out modes (a subprocess, in case a build without the check hangs), and the
    communicator stays usable for a paired send/recv to itself."""
    env = dict(os.environ, PYNCCL_FLIGHT_RECORDER_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _SELF_RECV, on_timeout], capture_output=True, text=True, timeout=45,
                          env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "REFUSED batch_isend_irecv: 0 send(s) to this rank (0) and 1 recv(s) from it" in out, out
    assert "COMPLETED" not in out and "PAIRED True" in out, out


# ----------------------------------------------------------------------------- life cycle
def test_abort_then_use_raises():
    comm = new_comm("ab")
    t = torch.ones(2, device="cuda")
    comm.all_reduce(t)
    assert comm.get_async_error() is None
    comm.check()
    comm.abort()
    assert comm.is_aborted()
    with pytest.raises(PyncclError, match=r"all_reduce: communicator 'ab' .* was aborted \(abort\(\) was called\)"):
        comm.all_reduce(t)
    comm.abort()  # idempotent
    comm.destroy()  # after abort: nothing collective left, no error
    with pytest.raises(PyncclError, match="was destroyed"):
        comm.broadcast(t, 0)


def test_destroy_then_use_raises():
    comm = new_comm("de")
    t = torch.ones(2, device="cuda")
    comm.all_reduce(t, ReduceOp.SUM, True).wait()
    comm.destroy()
    comm.destroy()  # idempotent
    assert not comm.is_aborted()
    for call in (lambda: comm.all_reduce(t), lambda: comm.barrier(), lambda: comm.split(0, 0),
                 lambda: comm.send(t, 0)):
        with pytest.raises((PyncclError, ValueError)):
            call()
    with pytest.raises(PyncclError, match="all_reduce: communicator 'de' .* was destroyed"):
        comm.all_reduce(t)


def test_split_and_properties(comm):
    assert (comm.rank, comm.world_size, comm.device, comm.name) == (0, 1, 0, "single")
    child = comm.split(0, 0, name="child")
    assert child.world_size == 1 and child.rank == 0 and child.name == "child"
    t = torch.ones(3, device="cuda")
    child.all_reduce(t, ReduceOp.premul_sum(2.0))
    torch.cuda.synchronize()
    assert torch.equal(t, torch.full((3,), 2.0, device="cuda"))
    child.destroy()
    assert comm.split(-1, 0) is None


def test_nccl_backend_binds_cpp_methods():
    from pynccl.comm.backends.nccl import NcclBackend

    backend = NcclBackend.create(C.get_unique_id(), 1, 0, "cuda:0", timeout=30.0, name="be")
    assert backend.comm.name == "be" and backend.device == torch.device("cuda", 0)
    assert type(backend.all_reduce).__name__ in ("builtin_function_or_method", "method")
    t = torch.ones(5, device="cuda")
    assert backend.all_reduce(t, ReduceOp.premul_sum(0.5), False) is None
    flat = torch.empty(5, device="cuda")
    backend.pack([t], flat, 2.0)
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.ones(5, device="cuda"))
    sub = backend.split([0], 30.0, "tp")
    assert isinstance(sub, NcclBackend) and sub.world_size == 1 and sub.comm.name == "tp"
    sub.destroy()
    backend.barrier()
    backend.destroy()


def test_flight_record(comm):
    c = new_comm("fr")
    t = torch.ones(3, device="cuda")
    c.all_reduce(t)
    c.broadcast(t, 0, True).wait()
    c.track_sync_ops = False
    c.reduce(t, 0, ReduceOp.SUM)
    c.track_sync_ops = True
    torch.cuda.synchronize()
    time.sleep(0.35)
    entries = c.flight_record()
    assert [e["op"] for e in entries] == ["all_reduce", "broadcast", "reduce"]
    assert [e["seq"] for e in entries] == [0, 1, 2]
    assert [e["state"] for e in entries] == ["completed", "completed", "untracked"]
    assert entries[1]["async_op"] and entries[1]["peer"] == 0 and entries[0]["dtype"] == "Float"
    assert entries[0]["count"] == 3 and abs(entries[0]["enqueue_time_us"] / 1e6 - time.time()) < 60
    c.flight_recorder_size = 2
    assert [e["seq"] for e in c.flight_record()] == [1, 2]
    c.destroy()
