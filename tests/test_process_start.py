"""How run_multiprocess starts its ranks (pynccl/testing/process_start.py). On a GPU host the parent
has touched the CUDA driver (pytest's skip markers ask torch.cuda.is_available()), so a forked CPU
rank inherits a GPU it cannot use: torch code that checks is_available() first (AdamW's capture
check, dynamo's RNG state, torch's PowerSGD hook) then fails with "CUDA error: initialization
error". CPU ranks there start from a fork server and see no GPU; GPU ranks are spawned."""
import os

import pytest
import torch

from pynccl.testing import process_start, run_multiprocess


@pytest.mark.parametrize("gpu, cuda, expected", [(False, False, "fork"), (False, True, "fork"),
                                                 (True, False, "forkserver"), (True, True, "spawn")])
def test_choose_by_host_and_ranks(monkeypatch, gpu, cuda, expected):
    monkeypatch.delenv(process_start.ENV, raising=False)
    monkeypatch.setattr(process_start, "host_has_gpu", lambda: gpu)
    assert process_start.choose(cuda) == expected
    assert process_start.choose(cuda, "spawn") == "spawn"        # the caller's choice stands


def test_choose_override_and_bad_names(monkeypatch):
    monkeypatch.setenv(process_start.ENV, "spawn")
    assert process_start.choose(False) == "spawn"
    assert process_start.choose(False, "fork") == "fork"
    monkeypatch.setenv(process_start.ENV, "threads")
    with pytest.raises(ValueError, match=r"PYNCCL_START_METHOD must be one of fork, spawn, forkserver, got 'threads'"):
        process_start.choose(False)
    with pytest.raises(ValueError, match=r"start_method must be one of .* got 'vfork'"):
        process_start.choose(False, "vfork")


def _where(rank, world_size, parent_pid):
    print(f"rank {rank} prints", flush=True)
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:   # the environment its parent started with
        parent_hides = b"CUDA_VISIBLE_DEVICES=" in f.read().split(b"\0")
    return {"own_parent": os.getppid() == parent_pid, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpus": torch.cuda.device_count(), "mark": os.environ.get("PYNCCL_TEST_MARK"),
            "parent_started_without_gpus": parent_hides}


@pytest.mark.parametrize("mark", ["first", "second"])   # the second run finds the server running
def test_cpu_ranks_on_a_gpu_host_see_no_gpu(monkeypatch, capfd, mark):
    """The GPU host's rule, taken on any host: the gloo ranks are children of the fork server, not
    of this process, and find no GPU; yet they print where this test's output goes and see the
    variables this test set (a server started before it has neither). Then the same ranks where no
    GPU is visible: forked from here, CUDA_VISIBLE_DEVICES as this process has it."""
    monkeypatch.delenv(process_start.ENV, raising=False)
    monkeypatch.setenv("PYNCCL_TEST_MARK", mark)
    monkeypatch.setattr(process_start, "host_has_gpu", lambda: True)
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    out = run_multiprocess(_where, 2, timeout=120, args=(os.getpid(),))
    # The server itself started without GPUs: what it imports before forking a rank (torch, pynccl,
    # transformers) may count them, and a forked rank inherits that count.
    assert out == [{"own_parent": False, "visible": "", "gpus": 0, "mark": mark,
                    "parent_started_without_gpus": True}] * 2, out
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before       # hidden only while the server started
    printed = capfd.readouterr().out
    assert "rank 0 prints" in printed and "rank 1 prints" in printed, printed
    monkeypatch.setattr(process_start, "host_has_gpu", lambda: False)
    out = run_multiprocess(_where, 2, timeout=120, args=(os.getpid(),))
    assert [o["own_parent"] for o in out] == [True, True], out
    assert [o["visible"] for o in out] == [os.environ.get("CUDA_VISIBLE_DEVICES")] * 2, out


def _cpu_training_that_asks_for_cuda(rank, world_size):
    """What failed in forked CPU ranks on a GPU host: AdamW's step (its capture check calls
    torch.cuda.is_current_stream_capturing() where CUDA is available) and a compiled function
    (dynamo saves the CUDA RNG state where CUDA is available), on gloo."""
    import pynccl
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 8)).sum().backward()
    for p in model.parameters():
        pynccl.all_reduce(p.grad)
    opt.step()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    return float(compiled(torch.ones(1))[0]), torch.cuda.device_count()


@pytest.mark.gpu
def test_cpu_ranks_after_the_parent_used_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    torch.ones(1, device="cuda").sum().item()          # this process now holds a CUDA context
    assert run_multiprocess(_cpu_training_that_asks_for_cuda, 2, timeout=300) == [(3.0, 0)] * 2
