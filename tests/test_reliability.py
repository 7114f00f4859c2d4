"""Nothing hangs, nothing is lost: time-outs, dead ranks, mismatch detection, flight recorder,
rendezvous errors (gloo backend; the NCCL watchdog is tested in test_nccl_timeouts_lifecycle.py)."""
import json
import os
import signal
import socket
import time

import pytest
import torch

import pynccl
from pynccl.comm.flight_recorder import FILE_KEYS
from pynccl.testing import run_multiprocess
from repo_env import subprocess_env

TIMEOUT_S = 3.0


def skipped_collective_case(rank, ws):
    t = torch.ones(4)
    pynccl.all_reduce(t)
    if rank == 1:
        time.sleep(TIMEOUT_S + 4)  # alive but never joins the second all_reduce
        return "skipped"
    start = time.monotonic()
    with pytest.raises(pynccl.CommTimeoutError) as info:
        pynccl.all_reduce(t)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "all_reduce (seq 2) on group 'world'" in msg, msg
    assert elapsed < TIMEOUT_S + 10, elapsed
    # The flight record names the op that never finished, and was written to disk.
    record = pynccl.flight_record()
    assert [(e["op"], e["seq"], e["state"]) for e in record[-2:]] == [
        ("all_reduce", 1, "completed"), ("all_reduce", 2, "timed_out")]
    assert record[-1]["dtype"] == "torch.float32" and record[-1]["count"] == 4
    path = msg.split("flight record: ")[1].split(")")[0]
    with open(path) as f:
        dumped = json.load(f)
    assert dumped["entries"][-1]["seq"] == 2 and dumped["rank"] == 0
    assert tuple(dumped) == FILE_KEYS and dumped["world_size"] == 2   # the C++ writer's keys
    return elapsed


def test_skipped_collective_times_out_instead_of_hanging(tmp_path):
    out = run_multiprocess(skipped_collective_case, 2, timeout=60, init_kwargs={"timeout": TIMEOUT_S},
                           env={"PYNCCL_FLIGHT_RECORDER_DIR": str(tmp_path)})
    assert out[1] == "skipped" and out[0] < TIMEOUT_S + 10


def killed_rank_case(rank, ws):
    t = torch.ones(1000)
    start = None
    try:
        for step in range(1000):
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 3:
                start = time.monotonic()
            pynccl.all_reduce(t)
            t.fill_(1.0)
    except pynccl.PyncclError as e:  # CommTimeoutError is one too
        elapsed = time.monotonic() - start
        assert "all_reduce" in str(e) and "group 'world'" in str(e), str(e)
        # The process can still exit cleanly after the error.
        pynccl.destroy_process_group()
        return elapsed
    raise AssertionError("training went on after rank 1 was killed")


def test_killed_rank_surfaces_on_every_survivor(tmp_path):
    out = run_multiprocess(killed_rank_case, 3, timeout=60, init_kwargs={"timeout": TIMEOUT_S},
                           expect_failure_ranks=[1], env={"PYNCCL_FLIGHT_RECORDER_DIR": str(tmp_path)})
    for r in (0, 2):
        assert out[r] is not None and out[r] < TIMEOUT_S + 10, out
    # each survivor wrote its flight record where it was told (not into the shared temp dir)
    assert sorted(p.name.split("_")[3] for p in tmp_path.glob("pynccl_flight_world_rank*.json")) == \
        ["rank0", "rank2"], list(tmp_path.iterdir())


def rendezvous_missing_rank_case(rank, ws):
    if rank == 2:
        os._exit(0)  # dies before rendezvous
    start = time.monotonic()
    with pytest.raises(pynccl.CommTimeoutError, match=r"ranks \[2\] never arrived"):
        pynccl.init_process_group(backend="gloo", timeout=TIMEOUT_S)
    return time.monotonic() - start


def test_rank_dead_during_rendezvous_is_named():
    out = run_multiprocess(rendezvous_missing_rank_case, 3, backend=None, timeout=60, expect_failure_ranks=[2])
    assert all(t < TIMEOUT_S + 10 for t in out[:2]), out


def duplicate_rank_case(rank, ws, claimed):
    if rank == ws - 1:
        os.environ["RANK"] = str(claimed)  # the last process claims an existing rank
    try:
        pynccl.init_process_group(backend="gloo", timeout=TIMEOUT_S)
    except (ValueError, pynccl.CommTimeoutError) as e:
        return str(e)
    return "initialised"


@pytest.mark.parametrize("claimed", [0, 1])
def test_two_processes_claiming_one_rank(claimed):
    out = run_multiprocess(duplicate_rank_case, 3, backend=None, timeout=60, args=(claimed,))
    expected = "address is in use (two processes claiming rank 0" if claimed == 0 else "two processes claim rank 1"
    assert any(expected in o for o in out), out
    assert "initialised" not in out, out


def wrong_world_size_case(rank, ws):
    if rank == 2:
        os.environ["WORLD_SIZE"] = "2"  # a third process joins a world of 2
        os.environ["RANK"] = "1"
    try:
        pynccl.init_process_group(backend="gloo", timeout=TIMEOUT_S)
    except (ValueError, pynccl.CommTimeoutError) as e:
        return str(e)
    pynccl.destroy_process_group()
    return "initialised"


def test_wrong_world_size_is_a_clear_error():
    out = run_multiprocess(wrong_world_size_case, 3, backend=None, timeout=60)
    assert any("started with world_size=2, but another process of this job with world_size=3" in o or
               "started with world_size=3, but another process of this job with world_size=2" in o for o in out), out
    assert "initialised" not in out, out


def mismatch_case(rank, ws):
    t = torch.ones(4 + (rank == 1))
    with pytest.raises(pynccl.CollectiveMismatchError) as info:
        pynccl.all_reduce(t)
    msg = str(info.value)
    assert "collective #1 on group 'world' differs across ranks in count" in msg, msg
    assert "rank 0: op=all_reduce, count=4" in msg and "rank 1: op=all_reduce, count=5" in msg, msg
    # different ops at the same position
    x = torch.ones(4)
    with pytest.raises(pynccl.CollectiveMismatchError, match="differs across ranks in op"):
        pynccl.all_reduce(x) if rank == 0 else pynccl.broadcast(x, src=0)
    with pytest.raises(pynccl.CollectiveMismatchError, match="in root"):
        pynccl.broadcast(x, src=rank)
    with pytest.raises(pynccl.CollectiveMismatchError, match="in dtype"):
        pynccl.all_reduce(x if rank == 0 else x.double())
    # matching calls still go through, and their values are right
    y = torch.full((3,), float(rank))
    pynccl.all_reduce(y)
    assert y.tolist() == [1.0] * 3
    return "ok"


def test_collective_mismatch_detected_on_every_rank():
    out = run_multiprocess(mismatch_case, 2, timeout=60, env={"PYNCCL_CHECK_COLLECTIVES": "1"})
    assert out == ["ok", "ok"]


def check_skip_case(rank, ws):
    x = torch.ones(2)
    if rank == 1:
        time.sleep(TIMEOUT_S + 3)
        return "slept"
    with pytest.raises(pynccl.CommTimeoutError, match=r"ranks \[1\] never reached this collective"):
        pynccl.all_reduce(x)
    return "ok"


def test_collective_check_names_the_missing_rank():
    out = run_multiprocess(check_skip_case, 2, timeout=60, init_kwargs={"timeout": TIMEOUT_S, "check_collectives": True})
    assert out == ["ok", "slept"]


def flight_ring_case(rank, ws):
    t = torch.ones(3)
    for _ in range(100):
        pynccl.all_reduce(t)
    pynccl.broadcast(t, src=1)
    record = pynccl.flight_record()
    assert len(record) == 64
    assert [e["seq"] for e in record] == list(range(38, 102))
    last = record[-1]
    assert (last["op"], last["peer"], last["state"], last["count"]) == ("broadcast", 1, "completed", 3)
    assert set(last) == {"op", "seq", "dtype", "count", "peer", "state", "enqueue_time_us"}
    return "ok"


def test_flight_recorder_keeps_the_last_64():
    assert run_multiprocess(flight_ring_case, 2) == ["ok", "ok"]


def store_binding_case(rank, ws):
    port = int(os.environ["MASTER_PORT"])
    if rank == 0:
        # Listening on MASTER_ADDR (127.0.0.1) only: another loopback address is refused.
        with socket.socket() as s:
            s.settimeout(2)
            with pytest.raises(OSError):
                s.connect(("127.0.0.2", port))
    pynccl.barrier()
    return "ok"


def test_store_binds_to_master_addr_only():
    assert run_multiprocess(store_binding_case, 2) == ["ok", "ok"]


class _StoreGoneAt:
    """A rendezvous store whose connection drops at its n-th call (rank 0, its host, has ended)."""

    def __init__(self, n):
        self.calls, self.n = 0, n

    def _call(self, reply):
        self.calls += 1
        if self.calls >= self.n:
            raise torch.distributed.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        return reply

    def compare_set(self, key, expected, desired):
        return self._call(desired.encode())

    def add(self, key, amount):
        return self._call(1)


@pytest.mark.parametrize("at", [1, 2, 3, 4])   # compare_set, the rank's key, the count, the wait
def test_a_store_lost_while_joining_is_a_clear_error(at):
    """CI saw it: in test_wrong_world_size_is_a_clear_error rank 0 found the world sizes differ and
    ended, closing the store, while the third process was still announcing itself; that process
    raised torch's bare DistNetworkError. Every store call of the rendezvous now ends so."""
    from pynccl.comm import rendezvous
    with pytest.raises(pynccl.CommTimeoutError, match=r"rank 2 lost the rendezvous store while joining 3 ranks "
                                                      r"\(rank 0, its host, gave up or died.*Failed to recv"):
        rendezvous._check_unique_rank(_StoreGoneAt(at), 2, 3, 5.0)


EXIT_SCRIPT = """
import sys
import torch
import torch.distributed as tdist
tdist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
import pynccl
from pynccl.comm import groups
groups._let_gloo_workers_finish = lambda: print("gloo workers given the GIL", flush=True)
model = pynccl.DistributedDataParallel(torch.nn.Linear(4, 4))     # pynccl bootstrapped from torch
model(torch.ones(2, 4)).sum().backward()
if sys.argv[1] == "pynccl-destroyed":
    pynccl.destroy_process_group()
tdist.destroy_process_group()
print("script end", flush=True)
"""


@pytest.mark.parametrize("ending", ["torch-only", "pynccl-destroyed"])
def test_gloo_workers_get_the_gil_before_interpreter_exit(tmp_path, ending):
    """A script that destroys torch's groups only (nanoGPT's train.py after pynccl's DDP bootstrapped
    from torch.distributed) leaves pynccl's gloo groups alive: pynccl's exit hook gives gloo's
    workers the GIL before finalization, as destroy_process_group does (a worker freeing a finished
    op's tensors during finalization aborts the process); after pynccl's own destroy, once only."""
    import subprocess
    import sys
    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT)
    env = subprocess_env()
    proc = subprocess.run([sys.executable, str(script), ending, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln in ("script end", "gloo workers given the GIL")]
    expected = {"torch-only": ["script end", "gloo workers given the GIL"],
                "pynccl-destroyed": ["gloo workers given the GIL", "script end"]}[ending]
    assert lines == expected, proc.stdout
