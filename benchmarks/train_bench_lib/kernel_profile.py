"""train_bench --profile: where a step's GPU time goes, by kernel category, for rank 0 of each run.

After the timed steps, PROFILED_STEPS more steps run under torch.profiler (CUDA kernels only) and
rank 0 prints, per step: the wall time; the time the GPU had at least one kernel running (the
union of every kernel's interval, any stream); the compute-only busy time (the union over
non-communication kernels); and each category's summed kernel time. Communication exposure is
read from it: comm time not under any compute kernel = busy - compute busy. A category's sum can
exceed the wall time where its kernels run concurrently on several streams.

Categories come from kernel names (the first pattern that matches, in CATEGORIES' order): NCCL
kernels and peer-to-peer copies (communication: NCCL's copy-engine collectives, e.g. ZeRO-3's
ring all-gathers, run as PtoP memcpys), other memcpy/memset, GEMMs (cuBLAS / cuBLASLt / CUTLASS / nvjet),
attention (flash / efficient / cudnn SDPA), Triton (inductor's fused kernels) and the rest
(eager elementwise and reductions). This is a diagnostic: the profiler adds a little host time per
kernel, so the timed steps of the row are measured without it.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

PROFILED_STEPS = 2
CATEGORIES: List[Tuple[str, re.Pattern]] = [
    ("nccl", re.compile(r"nccl", re.I)),
    ("peer copies", re.compile(r"memcpy.*PtoP|PtoP.*memcpy", re.I)),   # copy-engine collectives (NCCL >= 2.28)
    ("memcpy/memset", re.compile(r"memcpy|memset", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|sm\d+_xmma|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("triton", re.compile(r"^triton", re.I)),
    ("other", re.compile(r"")),
]
COMM = ("nccl", "peer copies")


def category(name: str) -> str:
    return next(cat for cat, pattern in CATEGORIES if pattern.search(name))


def _union_us(spans: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(kernels: List[Tuple[str, float, float]], steps: int, wall_ms: float) -> Dict[str, float]:
    """kernels: (name, start_us, end_us). Per-step milliseconds: wall, busy, compute_busy, exposed_comm
    and each category's sum."""
    by_cat: Dict[str, float] = {cat: 0.0 for cat, _ in CATEGORIES}
    for name, s, e in kernels:
        by_cat[category(name)] += e - s
    busy = _union_us([(s, e) for _, s, e in kernels])
    compute = _union_us([(s, e) for n, s, e in kernels if category(n) not in COMM])
    out = {"wall": wall_ms / steps, "busy": busy / 1e3 / steps, "compute_busy": compute / 1e3 / steps,
           "exposed_comm": (busy - compute) / 1e3 / steps}
    out.update({cat: us / 1e3 / steps for cat, us in by_cat.items()})
    return out


def profile_and_print(trainer, ctx, label: str) -> Dict[str, float]:
    """Every rank of the trainer runs PROFILED_STEPS steps under the profiler; rank 0 prints its own."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(PROFILED_STEPS):
            trainer.step()
        end.record()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    stats = summarize(kernels, PROFILED_STEPS, start.elapsed_time(end))
    dump = getattr(ctx.args, "profile_dump", None)
    if dump and ctx.rank == 0:
        _dump(prof, f"{dump}.{re.sub(r'[^A-Za-z0-9]+', '_', label)}.jsonl")
    if ctx.rank == 0:
        cells = " ".join(f"{k} {v:.2f}" for k, v in stats.items())
        print(f"# profile {label} (rank 0, ms per step): {cells}", flush=True)
    return stats


def _dump(prof, path: str) -> None:
    """Every CUDA kernel and copy of the profiled steps, one JSON object a line: for reading a
    timeline offline (which kernels ran beside which, where the GPU sat idle)."""
    import json
    with open(path, "w") as f:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
                f.write(json.dumps({"name": e.name, "stream": getattr(e, "device_resource_id", -1),
                                    "start": e.time_range.start, "end": e.time_range.end}) + "\n")
