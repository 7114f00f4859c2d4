"""Pipeline schedules measured: each rank's idle fraction (1 - compute time / step span) against
the textbook bubble (p - 1)/(v·m + p - 1), and the peak number of micro-batch activations a rank
holds (GPipe m, 1F1B min(p - rank, m)), with peak GPU memory on NCCL.

Stages have equal cost: on gloo they sleep a fixed time (forward --fwd-ms, backward --bwd-ms,
split over a rank's v stages), so the figure tests the schedule, not the two-core CPU; on GPUs
they run a fixed stack of --layers Linear(--hidden) + GELU layers.

    python benchmarks/pp_bench.py --nproc 4                       # gloo, p = 4, CPU
    python benchmarks/pp_bench.py --backend nccl                  # p = 1 on one GPU
    torchrun --nproc_per_node 4 benchmarks/pp_bench.py --backend nccl
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pynccl  # noqa: E402
from pynccl.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,  # noqa: E402
                             expected_bubble)

SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved": (ScheduleInterleaved1F1B, 2)}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, fwd_s, bwd_s):
        ctx.save_for_backward(x, w)
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        time.sleep(ctx.bwd_s)
        return grad * w, (grad * x).sum(0), None, None


class SleepStage(nn.Module):
    """A stage that costs fwd_s forward and bwd_s backward, whatever the micro-batch size."""

    def __init__(self, width, fwd_s, bwd_s):
        super().__init__()
        self.w = nn.Parameter(torch.ones(width))
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.fwd_s, self.bwd_s)


def _matmul_stage(hidden, layers):
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*mods)


class ComputeTimer:
    """schedule.compute_timer: wall time on CPU, CUDA events on GPU (stream time, so waits for
    messages, which sit between the events, do not count as compute)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self):
        self.busy_s, self.events = 0.0, []

    @contextlib.contextmanager
    def __call__(self, action):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.busy_s += time.perf_counter() - t0

    def total(self):
        return self.busy_s + sum(s.elapsed_time(e) for s, e in self.events) / 1e3


def _microbatch_counts(spec, p):
    out = []
    for tok in spec.split(","):
        tok = tok.strip()
        out.append(int(tok[:-1] or 1) * p if tok.endswith("p") else int(tok))
    return sorted(set(out))


def _measure(rank, world_size, args):
    pp_group = pynccl.get_default_group()
    p, device = world_size, pynccl.get_device()
    rows = []
    for name in args.schedules.split(","):
        cls, v = SCHEDULES[name]
        for m in _microbatch_counts(args.microbatches, p):
            if v > 1 and m % p:
                continue
            torch.manual_seed(0)
            stage_ids = list(range(rank, p * v, p))
            if args.stage == "sleep":
                mods = [SleepStage(args.width, args.fwd_ms / 1e3 / v, args.bwd_ms / 1e3 / v) for _ in stage_ids]
                x = torch.randn(m * args.microbatch_size, args.width)
            else:
                mods = [_matmul_stage(args.hidden, max(1, args.layers // v)).to(device) for _ in stage_ids]
                x = torch.randn(m * args.microbatch_size, args.hidden, device=device)
            stages = [PipelineStage(mod, k, p * v, device=device) for mod, k in zip(mods, stage_ids)]
            sched = cls(stages if v > 1 else stages[0], m, nn.functional.mse_loss)
            timer = ComputeTimer(device)
            sched.compute_timer = timer
            spans, busys = [], []
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for it in range(args.warmup + args.steps):
                for mod in mods:
                    mod.zero_grad(set_to_none=True)
                timer.reset()
                pynccl.barrier(pp_group)
                t0 = time.monotonic()
                sched.step(x, target=x)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t1 = time.monotonic()
                if it >= args.warmup:
                    spans.append((t0, t1))
                    busys.append(timer.total())
            everyone = [None] * p
            peak_mem = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0.0
            pynccl.all_gather_object(everyone, (spans, busys, sched.peak_live_activations, peak_mem))
            idle = [[] for _ in range(p)]
            step_s = []
            for i in range(args.steps):
                t0 = min(e[0][i][0] for e in everyone)
                t1 = max(e[0][i][1] for e in everyone)
                step_s.append(t1 - t0)
                for r in range(p):
                    idle[r].append(1.0 - everyone[r][1][i] / (t1 - t0))
            fastest = step_s.index(min(step_s))
            rows.append(dict(schedule=name, p=p, v=v, m=m, formula=expected_bubble(p, m, v),
                             idle=[statistics.median(x) for x in idle],
                             idle_fastest=[x[fastest] for x in idle],
                             idle_spread=[max(x) - min(x) for x in idle],
                             peak_live=[e[2] for e in everyone], step_ms=statistics.median(step_s) * 1e3,
                             peak_mem_mib=[round(e[3], 1) for e in everyone]))
    return rows


def _print(rows, args, backend):
    print(f"# pp_bench backend={backend} stage={args.stage} torch={torch.__version__} "
          f"steps={args.steps} warmup={args.warmup}")
    print("| schedule | p | v | m | (p-1)/(vm+p-1) | idle per rank (median step) | max dev | "
          "idle per rank (fastest step) | max dev | peak live activations per rank | step (ms, median) "
          "| peak mem MiB per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in rows:
        dev = max(abs(i - r["formula"]) for i in r["idle"])
        dev_fast = max(abs(i - r["formula"]) for i in r["idle_fastest"])
        worst = max(worst, dev)
        print(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['formula']:.4f} | "
              f"{' '.join(f'{i:.4f}' for i in r['idle'])} | {dev:.4f} | "
              f"{' '.join(f'{i:.4f}' for i in r['idle_fastest'])} | {dev_fast:.4f} | "
              f"{' '.join(str(x) for x in r['peak_live'])} | {r['step_ms']:.1f} | "
              f"{' '.join(str(x) for x in r['peak_mem_mib'])} |")
    print(f"# worst |idle - formula| over ranks and rows (median step) = {worst:.4f}")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=None, help="ranks to start here (not under torchrun)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--stage", choices=("sleep", "matmul"), default=None,
                    help="equal-cost stage (default: sleep on gloo, matmul on nccl)")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    ap.add_argument("--microbatches", default="1,p,2p,8", help="comma list; 'p', '2p' scale with p")
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--fwd-ms", type=float, default=100.0)
    ap.add_argument("--bwd-ms", type=float, default=200.0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=None, help="exit 1 if an idle fraction is further off")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.stage = args.stage or ("sleep" if args.backend == "gloo" else "matmul")
    if args.stage == "matmul" and args.backend == "nccl":
        args.microbatch_size = max(args.microbatch_size, 1024)

    if "RANK" in os.environ and args.nproc is None:      # torchrun
        pynccl.init_process_group(args.backend)
        rows = _measure(pynccl.get_rank(), pynccl.get_world_size(), args)
        is_zero = pynccl.get_rank() == 0
        pynccl.destroy_process_group()
    else:
        from pynccl.testing import run_multiprocess
        n = args.nproc or 1
        start = "spawn" if args.backend == "nccl" else None
        rows = run_multiprocess(_measure, n, backend=args.backend, timeout=3600, args=(args,), start_method=start)[0]
        is_zero = True
    if not is_zero:
        return 0
    worst = _print(rows, args, args.backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return 1 if args.tolerance is not None and worst > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
