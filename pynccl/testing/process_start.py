"""How run_multiprocess and `python -m pynccl.bench --nproc` start their ranks: fork, spawn or a
fork server, chosen by whether the host has a GPU and whether the ranks use it.

A forked child cannot use CUDA once its parent has touched the CUDA driver, and asking whether a
GPU is there (`torch.cuda.is_available()`, which pytest's skip markers do at collection) touches
it: the child's first CUDA call fails ("CUDA error: initialization error", or torch's "Cannot
re-initialize CUDA in forked subprocess"), and the child inherits the parent's count of devices,
so torch code that asks `is_available()` before its CUDA call (optimizers' capture check, dynamo's
RNG state, torch's PowerSGD hook) fails in CPU-only ranks too. So:

* no GPU visible (a CPU machine, CI): fork, as before: torch is already imported, so it is fast;
* ranks that use the GPU (`cuda=True`, e.g. NCCL): spawn, a fresh interpreter;
* CPU ranks on a GPU host: a fork server (started once, from a fresh interpreter, with torch and
  pynccl imported) whose children see no GPU (CUDA_VISIBLE_DEVICES=""), so a CPU test runs as it
  runs on a CPU machine, at about fork's cost.

PYNCCL_START_METHOD=fork|spawn|forkserver overrides the choice (where the caller names none).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
from typing import Iterator, Optional

import torch

ENV = "PYNCCL_START_METHOD"
METHODS = ("fork", "spawn", "forkserver")
# Imported by the fork server before it forks a child, where the caller has them imported.
_PRELOAD = ("torch", "torch._dynamo", "numpy", "transformers", "pynccl", "pynccl.testing")


def host_has_gpu() -> bool:
    return torch.cuda.is_available()


def choose(cuda: bool, requested: Optional[str] = None) -> str:
    """The start method for ranks that use CUDA (cuda=True) or not: `requested` if given, else
    PYNCCL_START_METHOD if set, else the module docstring's rule."""
    method = requested or os.environ.get(ENV) or None
    if method is not None:
        if method not in METHODS:
            source = "start_method" if requested else ENV
            raise ValueError(f"{source} must be one of {', '.join(METHODS)}, got {method!r}")
        return method
    if not host_has_gpu():
        return "fork"
    return "spawn" if cuda else "forkserver"


@contextlib.contextmanager
def _gpus_hidden(hide: bool) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES="" in this process's environment for the block: a process started in
    it (spawned, or the fork server) inherits it and finds no GPU."""
    if not hide:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def context(method: str, cuda: bool):
    """The multiprocessing context for `method`. For a fork server that is not running yet, it is
    started here, without GPUs where the ranks do not use CUDA (what it imports may count the GPUs,
    and every rank it forks would inherit that count), importing _PRELOAD's modules that this
    process has imported. A server already running (one per process) is used as it is."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver
        ctx.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules])
        with _gpus_hidden(not cuda):
            forkserver.ensure_running()
    return ctx


class _AsThisProcess:
    """Pickled into a rank's arguments: when unpickled there, the rank's stdout and stderr become
    duplicates of this process's, and its environment this process's (less the GPUs where the ranks
    do not use them), as they are when the rank is started. A fork server's child otherwise has
    the server's, which are this process's as they were when the server started: pytest captures
    each test's output in a file of its own, and a test sets variables for its ranks
    (monkeypatch.setenv). The descriptors travel the way multiprocessing sends a connection's
    (reduction.DupFd); fork and spawn inherit both anyway."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __reduce__(self):
        from multiprocessing import reduction
        sys.stdout.flush()
        sys.stderr.flush()
        environ = dict(os.environ)
        if not self.cuda:
            environ["CUDA_VISIBLE_DEVICES"] = ""
        return _take, (reduction.DupFd(1), reduction.DupFd(2), environ)


def _take(out, err, environ) -> None:
    for fd, dup in ((1, out), (2, err)):
        new = dup.detach()
        os.dup2(new, fd)
        os.close(new)
    os.environ.clear()
    os.environ.update(environ)


def _call(marker, target, *args):
    """A fork-server rank's target: `marker` (an _AsThisProcess) acted as it was unpickled, first of
    the arguments, so before `target`'s module is imported; then the rank's own target."""
    return target(*args)


class Starter:
    """Starts ranks as the module docstring says: `ctx` for the queues they report on, `process`
    for each rank, `start` for all of them."""

    def __init__(self, cuda: bool, requested: Optional[str] = None):
        self.cuda = cuda
        self.method = choose(cuda, requested)
        self.ctx = context(self.method, cuda)

    def process(self, target, name: str, args: tuple):
        if self.method == "forkserver":   # the rank takes this process's stdout and environment first
            target, args = _call, (_AsThisProcess(self.cuda), target, *args)
        return self.ctx.Process(target=target, name=name, args=args)

    def start(self, procs) -> None:
        """Spawned ranks that do not use CUDA start without GPUs (a forked child inherits the device
        count its parent saw: fork hides nothing)."""
        with _gpus_hidden(self.method == "spawn" and not self.cuda):
            for p in procs:
                p.start()
