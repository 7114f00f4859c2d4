"""Data parallelism (DDP or ZeRO) around a GPT stage, one training step over micro-batches
(pipelined when pp > 1), and gradient clipping by the norm over the whole mesh.

Everything takes the ParallelMesh explicitly: DDP and ZeRO reduce over mesh.dp_group, the
pipeline sends over mesh.pp_group, the TP layers were built on mesh.tp_group.

Supported: DDP (--zero 0) and ZeRO-3 with any tp, pp, sequence parallelism and activation
checkpointing; ZeRO-1/2 with any tp, SP and checkpointing at pp = 1. Refused, and why:
ZeRO-1/2 with pp > 1. They decide at forward time whether the next backward reduces (no_sync),
and reduce once every parameter has its gradient; a pipeline runs several forwards before the
backwards they belong to and ends with backwards that no forward armed, so some micro-batches'
gradients would be reduced a step late. ZeRO-3 instead reduce-scatters in the backward of every
micro-batch (the pipeline sees it without no_sync) and the shard gradients add up: exact.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Tuple

import torch
import torch.nn as nn

import pynccl
from pynccl.pipeline import PipelineStage, Schedule1F1B
from pynccl.tensor_parallel import ParallelTransformerBlock


def check_combination(mesh, zero: int) -> None:
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0 (DDP), 1, 2 or 3, got {zero}")
    if zero in (1, 2) and mesh.pp_size > 1:
        raise ValueError(f"--zero {zero} with --pp {mesh.pp_size} is not supported: ZeRO-{zero} decides in forward "
                         f"whether a backward reduces, and a pipeline interleaves micro-batches; use --zero 3 "
                         f"(reduces every micro-batch) or --zero 0 (DDP) with pipeline parallelism")


class _ReduceEveryMicroBatch(nn.Module):
    """A ZeRO-3 model seen by the pipeline without no_sync(): every micro-batch's backward
    reduce-scatters into the shards, which accumulate (see StepRunner)."""

    def __init__(self, fsdp: nn.Module):
        super().__init__()
        self.fsdp = fsdp

    def forward(self, *args):
        return self.fsdp(*args)


def wrap_data_parallel(stage: nn.Module, mesh, zero: int) -> nn.Module:
    """DDP over mesh.dp_group (zero=0; nothing to wrap when dp = 1), else ZeRO over mesh.dp_group."""
    if zero == 0:
        if mesh.dp_size == 1:
            return stage
        return pynccl.DistributedDataParallel(stage, process_group=mesh.dp_group)
    return pynccl.FullyShardedDataParallel(stage, stage=zero, process_group=mesh.dp_group,
                                           wrap_modules=[ParallelTransformerBlock] if zero == 3 else None)


def is_zero(model: nn.Module) -> bool:
    return isinstance(model, pynccl.FullyShardedDataParallel)


def unwrapped(model: nn.Module) -> nn.Module:
    """The GPT stage inside DDP / ZeRO (under ZeRO its parameters hold this rank's rows)."""
    return model.module if isinstance(model, (pynccl.DistributedDataParallel,
                                              pynccl.FullyShardedDataParallel)) else model


class StepRunner:
    """Forward and backward of one step's local batch, split into micro-batches; returns the
    mean loss on the last pipeline stage (None elsewhere). Gradients end up reduced over dp.

    DDP and ZeRO-1 hold full gradients anyway: they accumulate micro-batches locally (no_sync)
    and reduce once per step. ZeRO-2/3 exist to keep gradients sharded, so they reduce-scatter
    in every micro-batch's backward into shard gradients that add up (as DeepSpeed does): more
    traffic, no full-size gradient buffer."""

    def __init__(self, model: nn.Module, mesh, micro_batches: int, loss_fn: Callable):
        self.model, self.mesh, self.micro_batches, self.loss_fn = model, mesh, micro_batches, loss_fn
        self.accumulate_locally = not is_zero(model) or model.stage == 1
        self.schedule = None
        if mesh.pp_size > 1:
            # DDP: the stage runs micro-batches under no_sync and reduces in the last backward.
            piped = _ReduceEveryMicroBatch(model) if is_zero(model) else model
            device = next(iter(model.parameters())).device
            stage = PipelineStage(piped, mesh.pp_rank, mesh.pp_size, device=device, group=mesh.pp_group)
            self.schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=loss_fn)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor):
        if self.schedule is not None:
            losses: List[torch.Tensor] = []
            if self.mesh.is_first_stage:
                self.schedule.step(inputs)
            elif self.mesh.is_last_stage:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            return torch.stack(losses).mean() if losses else None
        m, total = self.micro_batches, 0.0
        for j, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m))):
            no_sync = getattr(self.model, "no_sync", None) if self.accumulate_locally and j < m - 1 else None
            with no_sync() if no_sync is not None else contextlib.nullcontext():
                loss = self.loss_fn(self.model(x), y)
                (loss / m).backward()
            total = total + loss.detach()
        return total / m


def _owned_grads(model: nn.Module, mesh, spec) -> Tuple[List[torch.Tensor], List[torch.Tensor], object]:
    """(grads this rank counts in the global norm, every grad it must scale, the group to sum over).

    Each gradient element of the whole mesh is counted exactly once: TP-replicated parameters
    (LayerNorms, row biases, position embeddings) only on tp_rank 0; pipeline stages hold
    disjoint layers; ZeRO's parameters hold disjoint rows over dp (sum over the world), while
    DDP's gradients are the same on every dp rank (sum over one replica, mesh.mp_group)."""
    counted, scaled = [], []
    for name, p in unwrapped(model).named_parameters():
        if p.grad is None:
            continue
        scaled.append(p.grad)
        if spec[name][0] is not None or mesh.tp_rank == 0:
            counted.append(p.grad)
    return counted, scaled, mesh.world_group if is_zero(model) else mesh.mp_group


def clip_grad_norm_(model: nn.Module, mesh, spec, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ (L2) of the single-process model, computed from this mesh's
    shards: one all-reduce of a scalar. Returns the total norm before clipping. Collective."""
    counted, scaled, group = _owned_grads(model, mesh, spec)
    device = scaled[0].device if scaled else next(iter(model.parameters())).device
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for g in counted:
        sq += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
    pynccl.all_reduce(sq, group=group)
    total = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in scaled:
            g.mul_(coef.to(g.dtype))
    return total.item()
