"""The torch side of every train_bench pair, written as a torch user would (torchtitan's choices
where it has one), each the counterpart of the algorithm pynccl runs:

  ddp          DistributedDataParallel
  zero1        DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer (the
               optimizer state sharded, gradients all-reduced: ZeRO-1), parameters as bucket views
  zero2        FSDP2, torchtitan's wrapping with reshard_after_forward=False (parameters gathered
               once per step, gradients reduce-scattered: ZeRO-2)
  zero3        FSDP2, torchtitan's wrapping (torch_fsdp.py)
  tp, tp-sp    DTensor parallelize_module with torch_tp_plan's plan; at world size 1 the plain
               model (the one-GPU reference of TP scaling, not DTensor on a 1-rank mesh)
  plain        the unwrapped model on one GPU (plain()): tp's one-GPU reference, the --floor of ddp and tp
  tp-sp-async  tp-sp compiled with inductor's async TP (--compile only)
  pp-*         torch.distributed.pipelining's schedules on the same HF stages pynccl pipelines
  tp2xdp2      FSDP2 (torchtitan's wrapping) over "dp" on top of TP over "tp" of a 2-D mesh
With ctx.compiled, each compiles as compile_recipes.py says (torchtitan: blocks compiled after TP
and before fully_shard; nanoGPT: torch.compile(model) inside DDP). DDP, ZeroRedundancyOptimizer and
FSDP2 run over ctx.torch_group (None: the default group; --floor: a 1-rank group, floor.py).
"""
from __future__ import annotations

import torch

from . import compile_recipes as cr
from .models import BenchContext, Trainer, hf_lm_step, layout_of, pipeline_trainer, pp_schedule
from .torch_fsdp import mixed_precision, titan_fully_shard
from .torch_tp_plan import loss_parallel_step, tensor_parallelize_llama


def build(strategy: str, ctx: BenchContext) -> Trainer:
    if strategy == "ddp":
        return _ddp(ctx, zero_optimizer=False)
    if strategy == "zero1":
        return _ddp(ctx, zero_optimizer=True)
    if strategy in ("zero2", "zero3"):
        return _fsdp2(ctx, reshard_after_forward=strategy == "zero3")
    if strategy in ("tp", "tp-sp", "tp-sp-async"):
        return _tp(ctx, sequence_parallel=strategy != "tp", async_tp=strategy == "tp-sp-async")
    if strategy.startswith("pp-"):
        return _pp(ctx, pp_schedule(strategy)[0])   # no CUDA-graph counterpart: eager
    if strategy == "tp2xdp2":
        return _fsdp2_tp(ctx)
    raise ValueError(f"torch runner: unknown strategy {strategy!r}")


def _device_type(ctx: BenchContext) -> str:
    return ctx.device.type


def _ddp(ctx: BenchContext, zero_optimizer: bool) -> Trainer:
    model = ctx.build_model("ddp")
    model = cr.model_if_compiled(ctx, model)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=ctx.torch_group)
    if zero_optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      process_group=ctx.torch_group,
                                      parameters_as_bucket_view=True, **ctx.adamw_kwargs())
    else:
        opt = ctx.optimizer(model.parameters())
    x = ctx.tokens(ctx.rank)
    return Trainer(hf_lm_step(ctx, model, opt, x, autocast=True), [model, opt], recipe=cr.recipe(ctx, cr.WHOLE))


def _dp_mesh(ctx: BenchContext):
    """FSDP2's 1-D mesh: every rank, or over ctx.torch_group (--floor's 1-rank group)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    if ctx.torch_group is None:
        return init_device_mesh(_device_type(ctx), (ctx.world_size,), mesh_dim_names=("dp",))
    return DeviceMesh.from_group(ctx.torch_group, _device_type(ctx), mesh_dim_names=("dp",))


def _fsdp2(ctx: BenchContext, reshard_after_forward: bool) -> Trainer:
    mesh = _dp_mesh(ctx)
    model = cr.blocks_if_compiled(ctx, ctx.build_model("zero3"))
    model = titan_fully_shard(model, mesh, mixed_precision(ctx), reshard_after_forward)
    opt = ctx.optimizer(model.parameters())
    x = ctx.tokens(ctx.rank)
    return Trainer(hf_lm_step(ctx, model, opt, x, autocast=False), [model, opt, mesh], recipe=cr.recipe(ctx, cr.BLOCKS))


def _check_llama(ctx: BenchContext, strategy: str):
    if ctx.args.model != "hf-llama":
        raise ValueError(f"{strategy}: the tensor-parallel plans are written for --model hf-llama "
                         f"(GPT-2's attention is one fused Conv1D), got --model {ctx.args.model}")


def _tp(ctx: BenchContext, sequence_parallel: bool, async_tp: bool) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    _check_llama(ctx, "tp")
    if async_tp and not ctx.compiled:
        raise ValueError("tp-sp-async: async TP is an inductor pass; run it with --compile")
    if ctx.world_size == 1:               # the one-GPU reference: the plain model, no DTensor
        return plain("tp", ctx)
    x = ctx.tokens(0)                     # one replica: every tp rank sees the same batch
    mesh = init_device_mesh(_device_type(ctx), (ctx.world_size,), mesh_dim_names=("tp",))
    model = cr.blocks_if_compiled(ctx, tensor_parallelize_llama(ctx.build_model("tp"), mesh, sequence_parallel))
    opt = ctx.optimizer(model.parameters())
    # Graphs compile at the first step: on from here, off again when the row is done (close).
    close = cr.enable_async_tp(mesh.get_group().group_name, ctx.device) if async_tp else None
    return Trainer(loss_parallel_step(ctx, model, opt, x, autocast=True), [model, opt, mesh], close=close,
                   recipe=cr.recipe(ctx, cr.ASYNC_TP if async_tp else cr.BLOCKS))


def plain(strategy: str, ctx: BenchContext) -> Trainer:
    """The unwrapped HF model, no wrapper and no collective: TP's one-GPU reference and the --floor
    of ddp and tp. Rank 0's batch, bf16 autocast and AdamW as the pair's; compiled as the pair
    compiles (ddp: the whole model, as nanoGPT; tp: each block, as torchtitan)."""
    whole = strategy == "ddp"
    model = (cr.model_if_compiled if whole else cr.blocks_if_compiled)(ctx, ctx.build_model(strategy))
    opt = ctx.optimizer(model.parameters())
    return Trainer(hf_lm_step(ctx, model, opt, ctx.tokens(0), autocast=True), [model, opt],
                   recipe=cr.recipe(ctx, cr.WHOLE if whole else cr.BLOCKS))


def _fsdp2_tp(ctx: BenchContext) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    _check_llama(ctx, "tp2xdp2")
    layout = layout_of("tp2xdp2", ctx.world_size)
    mesh = init_device_mesh(_device_type(ctx), (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    model = tensor_parallelize_llama(ctx.build_model("tp2xdp2"), mesh["tp"], sequence_parallel=False)
    model = titan_fully_shard(cr.blocks_if_compiled(ctx, model), mesh["dp"], mixed_precision(ctx))
    opt = ctx.optimizer(model.parameters())
    dp_rank, _, _ = layout.coords(ctx.rank)
    x = ctx.tokens(dp_rank)
    return Trainer(loss_parallel_step(ctx, model, opt, x, autocast=False), [model, opt, mesh],
                   recipe=cr.recipe(ctx, cr.BLOCKS))


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
