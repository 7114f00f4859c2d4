"""train_bench --floor: each pair's no-communication floor, measured in the same run, so that a
cost over the floor and TP's scaling come from one job on one machine.

After a pair's rows (one strategy, one mode), rank 0 alone trains the same per-GPU work at world
size 1, where no collective crosses a GPU, while the other ranks wait:

  zero1|zero2|zero3  each side's own wrapper over a 1-rank group of rank 0, built and compiled as the
                     pair's runner builds it: pynccl.FullyShardedDataParallel(stage=k,
                     process_group=<1-rank pynccl group>); FSDP2 fully_shard (torchtitan's wrapping)
                     over DeviceMesh.from_group(<1-rank torch group>), or for zero1 torch DDP +
                     ZeroRedundancyOptimizer over it. One floor row per side.
  ddp, tp, tp-sp(-async)  the unwrapped model (torch_runners.plain): the same autocast and AdamW,
                     compiled as the pair (ddp: the whole model; tp: each block). One row for both
                     sides; for tp it is the one-GPU step that TP's scaling divides by.
  pp-*, tp2xdp2      no floor (their per-GPU work at world size 1 is not one rank's share).

The runners take the groups through BenchContext (pynccl_group, torch_group, world_size 1, rank 0):
no runner is duplicated. The waiting ranks sit in a barrier of a gloo group made for it with a
long timeout (WAIT_TIMEOUT), not of the default group, whose timeouts (torch: 30 min for gloo and
for "cpu:gloo,cuda:nccl"; 10 min for a plain "nccl" group; pynccl: 600 s per operation) a compiled
1B floor must not race. While they wait, a collective of rank 0 over the default group could not
complete: a floor that communicated would hang into that group's timeout and fail, not pass.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Callable, List

import torch.distributed as tdist

import pynccl

from .harness import pool
from .models import BenchContext

WAIT_TIMEOUT = datetime.timedelta(hours=3)
ZERO = ("zero1", "zero2", "zero3")
PLAIN = ("ddp", "tp", "tp-sp", "tp-sp-async")


@dataclasses.dataclass
class FloorGroups:
    pynccl: object        # pynccl group over [0] (NON_GROUP_MEMBER on the other ranks)
    torch: object         # torch.distributed group over [0]
    wait: object          # gloo group over every rank: the others wait on it while rank 0 runs a floor


def make_groups() -> FloorGroups:
    """Collective over every rank (each new_group is), once, before the first pair."""
    return FloorGroups(pynccl=pynccl.new_group([0], group_desc="floor"), torch=tdist.new_group([0]),
                       wait=tdist.new_group(backend="gloo", timeout=WAIT_TIMEOUT))


def sides(strategy: str) -> tuple:
    """The floor rows of a strategy, by impl: each side's own (ZeRO) or one plain model."""
    if strategy in ZERO:
        return ("pynccl", "torch")
    if strategy in PLAIN:
        return ("plain",)
    return ()


def floor_context(ctx: BenchContext, groups: FloorGroups) -> BenchContext:
    """rank 0's context at world size 1: its groups hold rank 0 alone (checked, not assumed)."""
    sizes = (pynccl.get_world_size(groups.pynccl), tdist.get_world_size(groups.torch))
    if ctx.rank != 0 or sizes != (1, 1):
        raise RuntimeError(f"train_bench --floor: runs on rank 0 over 1-rank groups; got rank {ctx.rank}, "
                           f"pynccl and torch group sizes {sizes}")
    return dataclasses.replace(ctx, world_size=1, rank=0, pynccl_group=groups.pynccl, torch_group=groups.torch)


def run(ctx: BenchContext, strategy: str, groups: FloorGroups, run_one: Callable, repeats: int) -> List[dict]:
    """Every rank calls it after a pair; rank 0 returns the floor rows (the sides alternating over
    `repeats` runs and pooled, as the pair's), the others []. run_one(ctx, strategy, impl) -> row."""
    if not sides(strategy):
        return []
    rows = []
    try:
        if ctx.rank == 0:
            fctx = floor_context(ctx, groups)
            runs = {impl: [] for impl in sides(strategy)}
            for _ in range(repeats):
                for impl in runs:
                    runs[impl].append(run_one(fctx, strategy, impl))    # a failed build is an error row
            rows = [dict(pool(r), floor=True) for r in runs.values()]
    finally:
        tdist.barrier(group=groups.wait)      # NOTE: reached even if rank 0 raises: the others never wait 3 h
    return rows
