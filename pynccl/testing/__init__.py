"""Run a function on N processes, as a test would: free port, per-run timeout, every exit
code checked, the failing rank named with its traceback.

    def case(rank, world_size):
        t = torch.full((4,), float(rank))
        pynccl.all_reduce(t)
        assert t.tolist() == [sum(range(world_size))] * 4

    run_multiprocess(case, world_size=3)

How the ranks start (fork, spawn, or a fork server whose children see no GPU) is process_start.py's
rule: a CPU test runs on a GPU host as it runs on a CPU machine.

reference_models.py holds the unsharded GPT-2 modules that tests and benchmarks compare the
tensor-parallel ones against; multinode.py starts N torchrun agents on one host, each a node.
"""
from __future__ import annotations

import faulthandler
import gc
import os
import queue as queue_mod
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

from . import process_start


class MultiProcessError(AssertionError):
    """One or more ranks failed, hung or died; the message names each with its traceback."""


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, env, backend, init_kwargs, args, kwargs, results, stack_path=None):
    if stack_path is not None:
        # The parent sends SIGUSR1 to a rank that outlives the timeout: every thread's Python
        # stack goes to this file, so the error says where the rank hung.
        stack_file = open(stack_path, "w")
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    code = 0
    try:
        import pynccl
        if backend is not None:
            pynccl.init_process_group(backend=backend, **init_kwargs)
        try:
            value = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            # Reported before any teardown: destroy is collective (NCCL's finalize), and a peer
            # still waiting in a collective would hold it, so the error would show as a hang.
            results.put((rank, "error", traceback.format_exc()))
            code = 1
        if code:
            # NOTE: out of the except block and after a collection, so the traceback's frames and
            # what they held are gone: ncclCommAbort waits until every CUDA graph that captured
            # the communicator's collectives is destroyed (pynccl bounds that wait, then warns).
            gc.collect()
            if backend is not None and pynccl.is_initialized():
                pynccl.abort_process_group()
        else:
            if backend is not None and pynccl.is_initialized():
                pynccl.destroy_process_group()
            results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        try:
            results.close()
            results.join_thread()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _collect(procs, results, world_size: int, timeout: float, stack_paths: List[str], start: Callable):
    """Start the ranks (start(procs)) and wait for them: (outcomes by rank, hung ranks, their stacks)."""
    start(procs)
    outcomes: Dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
            outcomes[rank] = (status, value)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs):
                # Drain what is left, then stop waiting.
                try:
                    while True:
                        rank, status, value = results.get(timeout=0.5)
                        outcomes[rank] = (status, value)
                except queue_mod.Empty:
                    break
    hung = []
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        if p.is_alive():
            hung.append(r)
    stacks = {}
    if hung:
        for r in hung:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(1.0)
        for r in hung:
            procs[r].kill()
            procs[r].join(5.0)
            try:
                with open(stack_paths[r]) as f:
                    stacks[r] = f.read().strip()
            except OSError:
                stacks[r] = ""
    return outcomes, hung, stacks


def run_multiprocess(fn: Callable, world_size: int, backend: Optional[str] = "gloo", timeout: float = 120.0,
                     args: tuple = (), kwargs: Optional[dict] = None, env: Optional[Dict[str, str]] = None,
                     init_kwargs: Optional[dict] = None, start_method: Optional[str] = None,
                     expect_failure_ranks: Optional[List[int]] = None, cuda: Optional[bool] = None) -> List[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` processes.

    With backend set, each process calls pynccl.init_process_group(backend) first and
    destroy_process_group() after. Returns the per-rank return values. Raises
    MultiProcessError naming every rank that raised, exited non-zero or outlived `timeout`.
    cuda: whether the ranks use the GPU (default: backend "nccl" or start_method "spawn"); ranks
    that do not use it see none on a GPU host. start_method: process_start.choose's rule if None.
    """
    if cuda is None:
        cuda = backend == "nccl" or start_method == "spawn"
    starter = process_start.Starter(cuda, start_method)
    full_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()),
                "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"}
    full_env.update(env or {})
    results = starter.ctx.Queue()
    stack_dir = tempfile.mkdtemp(prefix="pynccl_stacks_")
    stack_paths = [os.path.join(stack_dir, f"rank{r}.txt") for r in range(world_size)]
    procs = [starter.process(_child, f"rank{r}", (fn, r, world_size, full_env, backend, init_kwargs or {}, args,
                                                  kwargs or {}, results, stack_paths[r]))
             for r in range(world_size)]
    try:
        outcomes, hung, stacks = _collect(procs, results, world_size, timeout, stack_paths, starter.start)
    finally:
        for p in procs:                    # e.g. Ctrl-C while waiting: no rank outlives the call
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(5.0)
        for path in stack_paths:
            try:
                os.remove(path)
            except OSError:
                pass
        try:
            os.rmdir(stack_dir)
        except OSError:
            pass

    expected_bad = set(expect_failure_ranks or [])
    failures = []
    for r, p in enumerate(procs):
        status, value = outcomes.get(r, (None, None))
        if r in hung:
            where = f"; its stacks then:\n{stacks[r]}" if stacks.get(r) else ""
            raised = f"rank {r} raised:\n{value}\nthen " if status == "error" else ""
            failures.append(f"{raised}rank {r}: still running after the {timeout:.0f}s timeout (killed){where}")
        elif status == "error":
            if r not in expected_bad:
                failures.append(f"rank {r} raised:\n{value}")
        elif p.exitcode != 0:
            if r not in expected_bad:
                failures.append(f"rank {r}: exited with code {p.exitcode} without reporting a result")
        elif status is None and r not in expected_bad:
            failures.append(f"rank {r}: exited 0 but reported no result")
    if failures:
        raise MultiProcessError(f"{fn.__name__} on {world_size} processes failed:\n" + "\n".join(failures))
    return [outcomes[r][1] if r in outcomes else None for r in range(world_size)]
