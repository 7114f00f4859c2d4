"""Time one built Trainer the same way for either side: warm-up steps, then timed steps (CUDA
events around each step on GPU, the host clock on CPU), the peak of torch.cuda.max_memory_allocated
from right after the build (so a model built whole and then sharded counts only what training
holds), and the loss of every step.

Ranks are combined over the CPU side-channel group (gloo): a step's time is the slowest rank's
(pipeline ranks finish at different times; the step ends when all have), memory is the largest
rank's, and a step's loss is the mean over the ranks that computed one (data-parallel replicas;
tensor-parallel ranks agree; in a pipeline only the last stage has it).
"""
from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.distributed as tdist

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


def measure(trainer: Trainer, ctx: BenchContext, tokens_per_step: int) -> dict:
    """Run --warmup + --steps steps; the row's numbers (identical on every rank)."""
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i in range(ctx.args.warmup + ctx.args.steps):
        ms, loss = _timed_step(trainer, cuda)
        losses.append(math.nan if loss is None else float(loss))
        if i >= ctx.args.warmup:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else math.nan

    # NOTE: collective over every rank; the default torch group routes CPU tensors to gloo.
    step_ms = torch.tensor(times, dtype=torch.float64)
    tdist.all_reduce(step_ms, op=tdist.ReduceOp.MAX)
    peak_t = torch.tensor([peak], dtype=torch.float64)
    tdist.all_reduce(peak_t, op=tdist.ReduceOp.MAX)
    have = torch.tensor([[0.0 if math.isnan(v) else v for v in losses],
                         [0.0 if math.isnan(v) else 1.0 for v in losses]], dtype=torch.float64)
    tdist.all_reduce(have)
    if (have[1] == 0).any():
        raise RuntimeError("train_bench: no rank reported a loss for some step")
    step_losses = (have[0] / have[1]).tolist()
    median = statistics.median(step_ms.tolist())
    return dict(median_ms=median, min_ms=min(step_ms.tolist()), tokens_per_s=tokens_per_step / (median / 1e3),
                peak_gib=peak_t.item(), loss=step_losses[-1], losses=step_losses)
