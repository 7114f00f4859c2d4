"""How long each fault takes to surface on the survivors (gloo, CPU): a rank killed mid-training,
a rank that skips one collective, a rank that dies before rendezvous. Prints seconds per rank.

    python benchmarks/fault_latency.py --timeout 3
"""
import argparse
import os
import signal
import time

import torch

import pynccl
from pynccl.testing import run_multiprocess


def _until_error(start: float, call):
    """(seconds from `start` until `call` raised pynccl's error, its class name), or None."""
    try:
        call()
    except pynccl.PyncclError as e:  # CommTimeoutError is one too
        return time.monotonic() - start, type(e).__name__
    return None


def killed(rank, ws):
    t = torch.ones(1000)
    for step in range(3):
        pynccl.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)

    def train():
        for _ in range(10_000):
            pynccl.all_reduce(t)
    return _until_error(time.monotonic(), train)


def skipped(rank, ws, timeout):
    t = torch.ones(4)
    pynccl.all_reduce(t)
    if rank == 1:
        time.sleep(timeout + 3)
        return None
    return _until_error(time.monotonic(), lambda: pynccl.all_reduce(t))


def missing_at_rendezvous(rank, ws, timeout):
    if rank == ws - 1:
        os._exit(0)
    return _until_error(time.monotonic(), lambda: pynccl.init_process_group(backend="gloo", timeout=timeout))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--nproc", type=int, default=3)
    a = p.parse_args()
    kw = {"init_kwargs": {"timeout": a.timeout}, "timeout": 120}
    rows = [
        ("rank 1 killed mid-training", run_multiprocess(killed, a.nproc, expect_failure_ranks=[1], **kw)),
        ("rank 1 skips one collective", run_multiprocess(skipped, 2, args=(a.timeout,), **kw)),
        (f"rank {a.nproc - 1} dies before rendezvous",
         run_multiprocess(missing_at_rendezvous, a.nproc, backend=None, args=(a.timeout,), timeout=120,
                          expect_failure_ranks=[a.nproc - 1])),
    ]
    print(f"gloo, group timeout {a.timeout:.1f} s, torch {torch.__version__}")
    for name, out in rows:
        got = ", ".join(f"rank {r}: {o[0]:.2f} s ({o[1]})" for r, o in enumerate(out) if o)
        print(f"{name:<34} {got}")


if __name__ == "__main__":
    main()
