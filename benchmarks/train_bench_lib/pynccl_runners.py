"""The pynccl side of every train_bench pair, written as a user would write it from pynccl's API:
DistributedDataParallel; FullyShardedDataParallel(stage=k, MixedPrecision(bf16, fp32)) with the
optimizer built from model.parameters(); tensor_parallel.parallelize_module with plans.llama; the
pipeline schedules on pynccl.pipeline.hf's stages; ZeRO-3 over the dp group of a ParallelMesh on
top of TP over its tp group. With ctx.compiled, as compile_recipes.py says: DDP and ZeRO-1 wrap
torch.compile(model) (nanoGPT's order; neither needs per-block gradients: DDP's compiled graph is
split at bucket boundaries by dynamo's DDPOptimizer, ZeRO-1 reduces after backward); ZeRO-2/3 and
TP compile each block (torchtitan's recipe), so that blocks' gradients come out one block at a
time and their reductions overlap the backward of the blocks before them.

The tensor-parallel API (parallelize_module, plans.llama) comes with issue #18's TP work and is
imported when a tp strategy runs, so the other strategies work in a checkout without it.
"""
from __future__ import annotations

import torch

import pynccl
from pynccl.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from pynccl.zero import MixedPrecision

from . import compile_recipes as cr
from .models import BenchContext, Trainer, hf_lm_step, pipeline_trainer, pp_schedule


def build(strategy: str, ctx: BenchContext) -> Trainer:
    if strategy == "ddp":
        return _ddp(ctx)
    if strategy.startswith("zero"):
        return _zero(ctx, int(strategy[-1]))
    if strategy in ("tp", "tp-sp", "tp-sp-async"):            # no async TP: tp-sp-async's torch side has it
        return _tp(ctx, sequence_parallel=strategy != "tp")
    if strategy.startswith("pp-"):
        return _pp(ctx, *pp_schedule(strategy))
    if strategy == "tp2xdp2":
        return _tp_zero3(ctx)
    raise ValueError(f"pynccl runner: unknown strategy {strategy!r}")


def _ddp(ctx: BenchContext) -> Trainer:
    model = ctx.build_model("ddp")
    model = cr.model_if_compiled(ctx, model)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    model = pynccl.DistributedDataParallel(model, device_ids=ids)
    opt = ctx.optimizer(model.parameters())
    return Trainer(hf_lm_step(ctx, model, opt, ctx.tokens(ctx.rank), autocast=True), [model, opt],
                   recipe=cr.recipe(ctx, cr.WHOLE))


def _mixed_precision(ctx: BenchContext):
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if ctx.bf16 else None


def _compiled_for_zero(ctx: BenchContext, model, stage: int):
    """(model, recipe): ZeRO-1 wraps torch.compile(model), ZeRO-2/3 compile each block."""
    if not ctx.compiled:
        return model, cr.EAGER
    if stage == 1:
        return cr.compile_model(model, ctx.args.compile_backend, ctx.args.compile_mode), cr.WHOLE
    return cr.compile_blocks(model, ctx.args.compile_backend, ctx.args.compile_mode), cr.BLOCKS


def _zero(ctx: BenchContext, stage: int) -> Trainer:
    model, recipe = _compiled_for_zero(ctx, ctx.build_model(f"zero{stage}"), stage)
    model = pynccl.FullyShardedDataParallel(model, stage=stage, process_group=ctx.pynccl_group,
                                            mixed_precision=_mixed_precision(ctx))
    if stage == 3 and ctx.rank == 0:                   # PYNCCL_ZERO3_SYMMETRIC: on, or why not
        print(f"# zero3 gathers: {model._runtime.describe_gather_ring()}", flush=True)
    impl = ctx.args.zero12_optim_impl if stage < 3 and ctx.args.zero12_optim_impl != "same" else None
    opt = ctx.optimizer(model.parameters(), impl=impl)
    return Trainer(hf_lm_step(ctx, model, opt, ctx.tokens(ctx.rank), autocast=False), [model, opt], recipe=recipe)


def _tensor_parallel_api():
    """(parallelize_module, plans), or a RuntimeError saying what is missing."""
    try:
        from pynccl.tensor_parallel import parallelize_module, plans
    except ImportError as e:
        raise RuntimeError(f"pynccl.tensor_parallel.parallelize_module / plans.llama (issue #18 item 1) "
                           f"are not in this checkout ({e})") from None
    return parallelize_module, plans


def _check_llama(ctx: BenchContext, strategy: str):
    if ctx.args.model != "hf-llama":
        raise ValueError(f"{strategy}: pynccl's tensor-parallel plan is plans.llama (--model hf-llama), "
                         f"got --model {ctx.args.model}")


def _tp(ctx: BenchContext, sequence_parallel: bool) -> Trainer:
    parallelize_module, plans = _tensor_parallel_api()
    _check_llama(ctx, "tp")
    model = parallelize_module(ctx.build_model("tp"), pynccl.get_default_group(),
                               plans.llama(sequence_parallel=sequence_parallel, sequence_dim=ctx.args.sp_dim))
    model = cr.blocks_if_compiled(ctx, model)
    opt = ctx.optimizer(model.parameters())
    return Trainer(hf_lm_step(ctx, model, opt, ctx.tokens(0), autocast=True), [model, opt],
                   recipe=cr.recipe(ctx, cr.BLOCKS))


def _tp_zero3(ctx: BenchContext) -> Trainer:
    parallelize_module, plans = _tensor_parallel_api()
    _check_llama(ctx, "tp2xdp2")
    mesh = pynccl.ParallelMesh(dp=ctx.world_size // 2, tp=2)
    model = parallelize_module(ctx.build_model("tp2xdp2"), mesh.tp_group, plans.llama(sequence_parallel=False))
    model = pynccl.FullyShardedDataParallel(cr.blocks_if_compiled(ctx, model), stage=3, process_group=mesh.dp_group,
                                            mixed_precision=_mixed_precision(ctx))
    opt = ctx.optimizer(model.parameters())
    return Trainer(hf_lm_step(ctx, model, opt, ctx.tokens(mesh.dp_rank), autocast=False), [model, opt, mesh],
                   recipe=cr.recipe(ctx, cr.BLOCKS))


def _pp(ctx: BenchContext, kind: str, cuda_graph: bool) -> Trainer:
    group = pynccl.get_default_group()

    def make_stage(mod, k, num_stages):
        return PipelineStage(mod, k, num_stages, device=ctx.device, group=group, cuda_graph=cuda_graph)
    return pipeline_trainer(ctx, kind, make_stage, {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                                                    "interleaved": ScheduleInterleaved1F1B})
