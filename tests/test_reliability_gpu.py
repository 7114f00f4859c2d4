"""Fault tests on NCCL across GPUs (skipped with fewer than 2), with on_timeout=raise
(PYNCCL_ON_TIMEOUT=raise): a killed rank and a skipped collective surface as exceptions on the
survivors within the timeout, never as a hang; the processes can still exit cleanly afterwards.
(The default, which ends the process, and more faults: test_faults_gpu.py. The single-GPU
watchdog and abort tests are in test_nccl_timeouts_lifecycle.py; the same scenarios on gloo run in CI
in test_reliability.py.)"""
import gc
import os
import signal
import time

import pytest
import torch

import pynccl
from pynccl.testing import run_multiprocess

TIMEOUT_S = 5.0
RAISE = {"PYNCCL_ON_TIMEOUT": "raise"}
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _killed_rank(rank, ws):
    t = torch.ones(1 << 16, device=pynccl.get_device())
    start = None
    try:
        for step in range(1000):
            if step == 3:
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                start = time.monotonic()
            pynccl.all_reduce(t)
            pynccl.barrier()          # a bounded host wait: the watchdog's timeout applies
    except pynccl.PyncclError as e:   # CommTimeoutError is one too
        elapsed = time.monotonic() - start
        pynccl.abort_process_group()  # local, never blocks
        return elapsed, str(e)
    raise AssertionError("training went on after rank 1 was killed")


def _skipped_collective(rank, ws):
    t = torch.ones(4, device=pynccl.get_device())
    pynccl.all_reduce(t)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(TIMEOUT_S + 5)     # alive, but never joins the second collective
        pynccl.abort_process_group()
        return None
    start = time.monotonic()
    with pytest.raises(pynccl.CommTimeoutError) as info:
        pynccl.all_reduce(t)
        pynccl.barrier()
    pynccl.abort_process_group()
    return time.monotonic() - start, str(info.value)


def _abort_with_a_live_graph(rank, ws, stderr_path):
    """ncclCommAbort does not return while a CUDA graph that captured the communicator's
    collectives is alive (NVIDIA/nccl src/init.cc, commDestroySync): pynccl's abort waits 10 s for
    it, says so on stderr and returns, leaving NCCL to finish once the graph is gone."""
    device = pynccl.get_device()
    t = torch.ones(1 << 10, device=device)
    pynccl.all_reduce(t)                      # connected before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pynccl.all_reduce(t)
    graph.replay()
    torch.cuda.synchronize()
    assert t[0].item() == ws ** 2, t[0].item()
    fd = os.open(f"{stderr_path}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(2)
    os.dup2(fd, 2)                            # the C++ warning goes to fd 2
    try:
        start = time.monotonic()
        pynccl.abort_process_group()          # the graph is alive: NCCL's abort would wait for ever
        elapsed = time.monotonic() - start
    finally:
        os.dup2(saved, 2)
        os.close(fd)
    del graph
    gc.collect()                              # now NCCL's abort can finish in the background
    with open(f"{stderr_path}.{rank}") as f:
        return elapsed, f.read()


@pytest.mark.multigpu
@needs_2_gpus
def test_abort_returns_while_a_captured_graph_is_alive(tmp_path):
    out = run_multiprocess(_abort_with_a_live_graph, 2, backend="nccl", start_method="spawn", timeout=120,
                           args=(str(tmp_path / "stderr"),))
    for elapsed, err in out:
        assert elapsed < 10 + 5, (elapsed, err)
        assert "has not returned after" in err and "CUDA graph" in err, err


@pytest.mark.multigpu
@needs_2_gpus
def test_killed_rank_surfaces_on_nccl():
    n = min(torch.cuda.device_count(), 4)
    out = run_multiprocess(_killed_rank, n, backend="nccl", start_method="spawn", timeout=120,
                           init_kwargs={"timeout": TIMEOUT_S}, expect_failure_ranks=[1], env=RAISE)
    for r in range(n):
        if r != 1:
            elapsed, msg = out[r]
            assert elapsed < TIMEOUT_S + 10, (r, elapsed, msg)


@pytest.mark.multigpu
@needs_2_gpus
def test_skipped_collective_times_out_on_nccl():
    out = run_multiprocess(_skipped_collective, 2, backend="nccl", start_method="spawn", timeout=120,
                           init_kwargs={"timeout": TIMEOUT_S}, env=RAISE)
    elapsed, msg = out[0]
    assert elapsed < TIMEOUT_S + 10, (elapsed, msg)
    assert "'world'" in msg and "seq" in msg and "did not complete within" in msg, msg
