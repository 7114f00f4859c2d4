"""Host time of one all_reduce call on a 1-element CUDA tensor, world size 1: pynccl against
torch.distributed (NCCL) in the same process and on the same GPU.

At world size 1 an in-place SUM makes NCCL enqueue no GPU work, so the time per call is the
host path alone: Python, the binding, the checks, the flight recorder, the watchdog's event.
Also: out-of-place all_reduce (pynccl's output= against torch's copy_ + in-place) and
batch_isend_irecv (send + recv to self, then wait), each against its torch counterpart.
Each variant runs N back-to-back calls per repetition (the GPU is synchronised outside the
timed loop); the table shows the median and the best repetition, variants interleaved.

    python benchmarks/host_overhead.py [--iters 2000] [--reps 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _time_per_call_us(call, args, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for _ in range(iters):
        call(*args)
    elapsed = time.perf_counter_ns() - start
    torch.cuda.synchronize()
    return elapsed / iters / 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="calls per timed repetition")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("host_overhead: needs a CUDA GPU")
    torch.cuda.set_device(0)

    import pynccl
    from pynccl import _ext
    from pynccl.comm.backends.nccl import NcclBackend
    from pynccl.comm.reduce_op import ReduceOp
    c = _ext.require_extension("benchmarks/host_overhead.py")

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    tensor = torch.ones(1, device="cuda")
    variants = {"torch.distributed.all_reduce (nccl)": (dist.all_reduce, (tensor,))}

    notes = []
    try:
        pynccl.init_process_group("nccl")
        variants["pynccl.all_reduce"] = (pynccl.all_reduce, (tensor,))
    except Exception as e:  # the distributed layer is optional here: report and go on
        notes.append(f"pynccl.all_reduce skipped: {type(e).__name__}: {e}")
    backend = NcclBackend.create(c.get_unique_id(), 1, 0, 0, timeout=600.0, name="host_overhead")
    variants["NcclBackend.all_reduce (bound C++ method)"] = (backend.all_reduce, (tensor, ReduceOp.SUM, False))
    untracked = NcclBackend.create(c.get_unique_id(), 1, 0, 0, timeout=600.0, name="untracked")
    untracked.comm.track_sync_ops = False
    variants["  same, track_sync_ops=False (no watchdog event)"] = (untracked.all_reduce,
                                                                     (tensor, ReduceOp.SUM, False))
    variants["  same, ReduceOp.premul_sum(0.5) (one GPU kernel)"] = (backend.all_reduce,
                                                                      (tensor, ReduceOp.premul_sum(0.5), False))

    # Out-of-place and point-to-point rows; each is compared with the torch row it names.
    # NOTE: torch has no out-of-place all_reduce: its row is copy_ + in-place, as in the bench.
    out = torch.empty_like(tensor)
    baseline_of = {}

    def torch_out_of_place(src, dst):
        dst.copy_(src)
        dist.all_reduce(dst)
    T_OOP = "torch copy_ + all_reduce (out-of-place)"
    variants[T_OOP] = (torch_out_of_place, (tensor, out))
    variants["NcclBackend.all_reduce(output=) (one NCCL call)"] = (
        functools.partial(backend.all_reduce, output=out), (tensor, ReduceOp.SUM, False))
    baseline_of["NcclBackend.all_reduce(output=) (one NCCL call)"] = T_OOP
    recv = torch.empty_like(tensor)

    def p2p_round(api, ops):  # one batch_isend_irecv (send+recv to self, 4 B) and its waits
        for work in api.batch_isend_irecv(ops):
            work.wait()
    T_P2P = "torch batch_isend_irecv (send+recv to self)"
    variants[T_P2P] = (p2p_round, (dist, [dist.P2POp(dist.isend, tensor, 0), dist.P2POp(dist.irecv, recv, 0)]))
    if "pynccl.all_reduce" in variants:
        variants["pynccl.batch_isend_irecv (send+recv to self)"] = (
            p2p_round, (pynccl, [pynccl.P2POp(pynccl.isend, tensor, 0), pynccl.P2POp(pynccl.irecv, recv, 0)]))
        baseline_of["pynccl.batch_isend_irecv (send+recv to self)"] = T_P2P

    def backend_p2p(ops):
        backend.batch_isend_irecv(ops).wait()
    variants["NcclBackend.batch_isend_irecv (tuples, bound C++)"] = (backend_p2p, ([(True, tensor, 0), (False, recv, 0)],))
    baseline_of["NcclBackend.batch_isend_irecv (tuples, bound C++)"] = T_P2P

    for call, call_args in variants.values():
        for _ in range(args.warmup):
            call(*call_args)
    samples = {name: [] for name in variants}
    for _ in range(args.reps):  # interleaved, so drift hits every variant alike
        for name, (call, call_args) in variants.items():
            samples[name].append(_time_per_call_us(call, call_args, args.iters))

    rows = []
    for name, values in samples.items():
        median = statistics.median(values)
        base = statistics.median(samples[baseline_of.get(name, "torch.distributed.all_reduce (nccl)")])
        rows.append({"impl": name, "median_us": median, "min_us": min(values), "ratio_vs_torch": median / base,
                     "torch_baseline": baseline_of.get(name, "torch.distributed.all_reduce (nccl)")})
    versions = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": str(pynccl.nccl_version()),
        "torch_nccl": ".".join(map(str, torch.cuda.nccl.version())), "driver": _driver(),
        "gpu": torch.cuda.get_device_name(0), "python": platform.python_version(),
        "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(f"host time per call, 1 x float32, world size 1: median of {args.reps} x {args.iters} calls "
          "(out-of-place rows vs torch copy_+op, batch_isend_irecv rows vs torch's)")
    print(" ".join(f"{k}={v}" for k, v in versions.items()))
    print(f"{'impl':<56} {'median us':>10} {'min us':>8} {'vs torch':>9}")
    for r in rows:
        print(f"{r['impl']:<56} {r['median_us']:>10.2f} {r['min_us']:>8.2f} {r['ratio_vs_torch']:>8.3f}x")
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "host_overhead", "iters": args.iters, "reps": args.reps, "versions": versions,
                       "results": rows, "samples_us": samples, "notes": notes}, f, indent=1)

    for be in (backend, untracked):
        be.destroy()
    try:
        pynccl.destroy_process_group()
    except Exception:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
