"""The torch side of every train_bench pair, written as a torch user would (torchtitan's choices
where it has one): DistributedDataParallel; FSDP2 (fully_shard per decoder block, then the root,
MixedPrecisionPolicy(bf16 params, fp32 reduce)) for every ZeRO stage; DTensor
parallelize_module with torch_tp_plan's plan; torch.distributed.pipelining's schedules on the
same HF stages pynccl pipelines; FSDP2 over "dp" on top of TP over "tp" of a 2-D device mesh.
"""
from __future__ import annotations

import torch

from .models import BenchContext, Trainer, hf_lm_step, layout_of, pipeline_trainer, pp_schedule
from .torch_tp_plan import loss_parallel_step, tensor_parallelize_llama


def build(strategy: str, ctx: BenchContext) -> Trainer:
    if strategy == "ddp":
        return _ddp(ctx)
    if strategy.startswith("zero"):
        return _fsdp2(ctx)
    if strategy in ("tp", "tp-sp"):
        return _tp(ctx, sequence_parallel=strategy == "tp-sp")
    if strategy.startswith("pp-"):
        return _pp(ctx, pp_schedule(strategy)[0])   # no CUDA-graph counterpart: eager
    if strategy == "tp2xdp2":
        return _fsdp2_tp(ctx)
    raise ValueError(f"torch runner: unknown strategy {strategy!r}")


def _device_type(ctx: BenchContext) -> str:
    return ctx.device.type


def _ddp(ctx: BenchContext) -> Trainer:
    model = ctx.build_model("ddp")
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = ctx.optimizer(model.parameters())
    x = ctx.tokens(ctx.rank)
    return Trainer(hf_lm_step(ctx, model, opt, x, autocast=True), [model, opt])


def _fsdp_kwargs(ctx: BenchContext, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    kw = dict(mesh=mesh)
    if ctx.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return kw


def _fully_shard_blocks(model, kw):
    from torch.distributed.fsdp import fully_shard
    blocks = model.model.layers if hasattr(model, "model") else model.transformer.h
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp2(ctx: BenchContext) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(_device_type(ctx), (ctx.world_size,), mesh_dim_names=("dp",))
    model = _fully_shard_blocks(ctx.build_model("zero3"), _fsdp_kwargs(ctx, mesh))
    opt = ctx.optimizer(model.parameters())
    x = ctx.tokens(ctx.rank)
    return Trainer(hf_lm_step(ctx, model, opt, x, autocast=False), [model, opt, mesh])


def _check_llama(ctx: BenchContext, strategy: str):
    if ctx.args.model != "hf-llama":
        raise ValueError(f"{strategy}: the tensor-parallel plans are written for --model hf-llama "
                         f"(GPT-2's attention is one fused Conv1D), got --model {ctx.args.model}")


def _tp(ctx: BenchContext, sequence_parallel: bool) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    _check_llama(ctx, "tp")
    mesh = init_device_mesh(_device_type(ctx), (ctx.world_size,), mesh_dim_names=("tp",))
    model = tensor_parallelize_llama(ctx.build_model("tp"), mesh, sequence_parallel)
    opt = ctx.optimizer(model.parameters())
    x = ctx.tokens(0)                     # one replica: every tp rank sees the same batch
    return Trainer(loss_parallel_step(ctx, model, opt, x, autocast=True), [model, opt, mesh])


def _fsdp2_tp(ctx: BenchContext) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    _check_llama(ctx, "tp2xdp2")
    layout = layout_of("tp2xdp2", ctx.world_size)
    mesh = init_device_mesh(_device_type(ctx), (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    model = tensor_parallelize_llama(ctx.build_model("tp2xdp2"), mesh["tp"], sequence_parallel=False)
    model = _fully_shard_blocks(model, _fsdp_kwargs(ctx, mesh["dp"]))
    opt = ctx.optimizer(model.parameters())
    dp_rank, _, _ = layout.coords(ctx.rank)
    x = ctx.tokens(dp_rank)
    return Trainer(loss_parallel_step(ctx, model, opt, x, autocast=False), [model, opt, mesh])


def _pp(ctx: BenchContext, kind: str) -> Trainer:
    from torch.distributed import pipelining

    def make_stage(mod, k, num_stages):
        return pipelining.PipelineStage(mod, k, num_stages, ctx.device)
    return pipeline_trainer(ctx, kind, make_stage, {"gpipe": pipelining.ScheduleGPipe,
                                                    "1f1b": pipelining.Schedule1F1B,
                                                    "interleaved": pipelining.ScheduleInterleaved1F1B})


def torch_nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
        return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001 - a CPU-only build has no NCCL
        return f"n/a ({type(e).__name__})"
