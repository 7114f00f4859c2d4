"""Time one built Trainer the same way for either side: warm-up steps, then timed steps (CUDA
events around each step on GPU, the host clock on CPU), the peak of torch.cuda.max_memory_allocated
from right after the build (so a model built whole and then sharded counts only what training
holds), and the loss of every step.

Ranks are combined over the CPU side-channel group (gloo): a step's time is the slowest rank's
(pipeline ranks finish at different times; the step ends when all have), memory is the largest
rank's, and a step's loss is the mean over the ranks that computed one (data-parallel replicas;
tensor-parallel ranks agree; in a pipeline only the last stage has it). A trainer of world size 1
(ctx.world_size; --floor's, run by rank 0 while the others wait) combines nothing: no barrier, no
collective.
"""
from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.distributed as tdist

from pynccl.comm.symmetric import window_bytes

from .models import BenchContext, Trainer


def free_device_memory(ctx: BenchContext) -> None:
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _timed_step(trainer: Trainer, cuda: bool):
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = trainer.step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), loss
    t0 = time.perf_counter()
    loss = trainer.step()
    return 1e3 * (time.perf_counter() - t0), loss


def measure(trainer: Trainer, ctx: BenchContext, tokens_per_step: int, base_bytes: int = 0,
            base_window_bytes: int = 0) -> dict:
    """Run --warmup + --steps steps; the row's numbers (identical on every rank). base_bytes: what
    was allocated before the trainer was built (an earlier run's leftovers), not counted in the peak;
    base_window_bytes: window_bytes() then. peak_gib = peak_allocated_gib (max_memory_allocated) +
    window_gib (symmetric windows, held from the build to the end: they add to any moment's peak).
    wall_ms: the timed steps' wall time / steps, from a barrier before the first to one after the
    last (the throughput view: no per-step maximum over ranks that are out of phase)."""
    cuda = ctx.device.type == "cuda"
    # NOTE: a floor (world size 1 inside a larger job) must not touch the default group: the other
    # ranks wait elsewhere (floor.py).
    barrier = tdist.barrier if ctx.world_size > 1 else _no_op
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    t0 = None
    for i in range(ctx.args.warmup + ctx.args.steps):
        if i == ctx.args.warmup:
            barrier()
            t0 = time.perf_counter()
        ms, loss = _timed_step(trainer, cuda)
        losses.append(math.nan if loss is None else float(loss))
        if i >= ctx.args.warmup:
            times.append(ms)
    barrier()
    wall = torch.tensor([1e3 * (time.perf_counter() - t0) / max(1, ctx.args.steps)], dtype=torch.float64)
    peak = (torch.cuda.max_memory_allocated() - base_bytes) / 2 ** 30 if cuda else math.nan
    windows = (window_bytes() - base_window_bytes) / 2 ** 30

    step_ms = torch.tensor(times, dtype=torch.float64)
    peak_t = torch.tensor([peak + windows, peak, windows], dtype=torch.float64)     # the largest rank's each
    have = torch.tensor([[0.0 if math.isnan(v) else v for v in losses],
                         [0.0 if math.isnan(v) else 1.0 for v in losses]], dtype=torch.float64)
    if ctx.world_size > 1:
        # NOTE: collective over every rank; the default torch group routes CPU tensors to gloo.
        for t in (step_ms, peak_t, wall):
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        tdist.all_reduce(have)
    if (have[1] == 0).any():
        raise RuntimeError("train_bench: no rank reported a loss for some step")
    step_losses = (have[0] / have[1]).tolist()
    median = statistics.median(step_ms.tolist())
    return dict(median_ms=median, min_ms=min(step_ms.tolist()), tokens_per_s=tokens_per_step / (median / 1e3),
                peak_gib=peak_t[0].item(), peak_allocated_gib=peak_t[1].item(), window_gib=peak_t[2].item(),
                loss=step_losses[-1], losses=step_losses, step_ms=step_ms.tolist(),
                wall_ms=wall.item(),
                tokens_per_step=tokens_per_step)


def _no_op() -> None:
    pass


def pool(runs: list) -> dict:
    """One row from --repeats runs of the same (strategy, side): step times pooled (median and min over
    all), the largest peak, the losses of the last run (every run starts from the same weights)."""
    if len(runs) == 1 or any(r.get("error") for r in runs):
        return next((r for r in runs if r.get("error")), runs[-1])
    row = dict(runs[-1])
    times = [t for r in runs for t in r["step_ms"]]
    row.update(median_ms=statistics.median(times), min_ms=min(times), step_ms=times, repeats=len(runs),
               peak_gib=max(r["peak_gib"] for r in runs), peak_allocated_gib=max(r["peak_allocated_gib"] for r in runs),
               window_gib=max(r["window_gib"] for r in runs), wall_ms=statistics.mean(r["wall_ms"] for r in runs))
    row["tokens_per_s"] = row["tokens_per_step"] / (row["median_ms"] / 1e3)
    return row
