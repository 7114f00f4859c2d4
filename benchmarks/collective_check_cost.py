"""Cost per call of PYNCCL_CHECK_COLLECTIVES (signature exchange through the store), as the
time of a small all_reduce with and without the check, in the same processes' run.

    python benchmarks/collective_check_cost.py --backend gloo --nproc 2 --iters 2000
    python benchmarks/collective_check_cost.py --backend nccl --nproc 1          # one GPU
"""
import argparse
import statistics
import time

import torch

import pynccl
from pynccl.testing import run_multiprocess


def _time_calls(t, iters, sync):
    for _ in range(20):
        pynccl.all_reduce(t)
    sync()
    reps = []
    for _ in range(5):
        pynccl.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            pynccl.all_reduce(t)
        sync()
        reps.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(reps), min(reps), max(reps)


def case(rank, ws, backend, iters):
    device = pynccl.get_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t = torch.ones(1, device=device)
    results = {}
    for check in (False, True):
        pynccl.destroy_process_group()
        pynccl.init_process_group(backend=backend, check_collectives=check)
        results[check] = _time_calls(t, iters, sync)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args()
    out = run_multiprocess(case, a.nproc, backend=a.backend, timeout=600, args=(a.backend, a.iters),
                           start_method="spawn" if a.backend == "nccl" else None)
    off, on = out[0][False], out[0][True]
    print(f"backend={a.backend} nproc={a.nproc} torch={torch.__version__}")
    print(f"{'check':>6} {'median us/call':>15} {'min':>8} {'max':>8}")
    print(f"{'off':>6} {off[0]:15.1f} {off[1]:8.1f} {off[2]:8.1f}")
    print(f"{'on':>6} {on[0]:15.1f} {on[1]:8.1f} {on[2]:8.1f}")
    print(f"check cost per call: {on[0] - off[0]:.1f} us (×{on[0] / off[0]:.1f})")


if __name__ == "__main__":
    main()
