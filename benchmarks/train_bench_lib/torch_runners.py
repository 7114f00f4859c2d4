"""The torch side of every train_bench pair, written as a torch user would (torchtitan's choices
where it has one): DistributedDataParallel; FSDP2 (fully_shard per decoder block, then the root,
MixedPrecisionPolicy(bf16 params, fp32 reduce)) for every ZeRO stage; DTensor
parallelize_module with torch_tp_plan's plan; torch.distributed.pipelining's schedules on the
same HF stages pynccl pipelines; FSDP2 over "dp" on top of TP over "tp" of a 2-D device mesh.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from .models import BenchContext, Trainer, hf_lm_step, layout_of
from .torch_tp_plan import loss_parallel_step, tensor_parallelize_llama


def build(strategy: str, ctx: BenchContext) -> Trainer:
    if strategy == "ddp":
        return _ddp(ctx)
    if strategy.startswith("zero"):
        return _fsdp2(ctx)
    if strategy in ("tp", "tp-sp"):
        return _tp(ctx, sequence_parallel=strategy == "tp-sp")
    if strategy.startswith("pp-"):
        return _pp(ctx, strategy[3:])
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

    from pynccl.pipeline import causal_lm_loss, hf_stage_modules
    pp, pp_rank = ctx.world_size, ctx.rank
    v = 2 if kind == "interleaved" else 1
    num_stages = pp * v
    model = ctx.build_model(f"pp-{kind}")
    mods = hf_stage_modules(model, pp_rank, pp, stages_per_rank=v)
    del model                                   # only this rank's stages stay referenced
    stages = [pipelining.PipelineStage(mod, k, num_stages, ctx.device)
              for mod, k in zip(mods, range(pp_rank, num_stages, pp))]
    m = ctx.args.microbatches
    if kind == "gpipe":
        sched = pipelining.ScheduleGPipe(stages[0], m, loss_fn=causal_lm_loss)
    elif kind == "1f1b":
        sched = pipelining.Schedule1F1B(stages[0], m, loss_fn=causal_lm_loss)
    else:
        sched = pipelining.ScheduleInterleaved1F1B(stages, m, loss_fn=causal_lm_loss)
    opt = ctx.optimizer([p for mod in mods for p in mod.parameters()])
    x = ctx.tokens(0)
    has_first, has_last = pp_rank == 0, pp_rank == (num_stages - 1) % pp

    def step():
        losses = []
        with ctx.autocast():
            if has_first:
                sched.step(x, target=x if has_last else None, losses=losses)
            elif has_last:
                sched.step(target=x, losses=losses)
            else:
                sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if losses else None
    return Trainer(step, [mods, stages, sched, opt])


def torch_nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
        return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001 - a CPU-only build has no NCCL
        return f"n/a ({type(e).__name__})"


def barrier() -> None:
    tdist.barrier()
