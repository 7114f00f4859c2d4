"""train_bench --compile: how each side compiles, the way each library's users write it.

  compile(model)   torch.compile(model), then the wrapper around it: nanoGPT's train.py
                   (`model = torch.compile(model)`, then `DDP(model)`). torch DDP's compiled
                   graph is split at bucket boundaries by dynamo's DDPOptimizer
                   (torch._dynamo.config.optimize_ddp, on by default), so gradients become ready,
                   and buckets reduce, while the compiled backward goes on; pynccl's DDP takes
                   part in the same splitting (pynccl/ddp/module.py). Used for DDP and ZeRO-1
                   (which reduces after backward anyway) on both sides.
  compile(blocks)  each transformer block's module.compile(), before the block is sharded and
                   after tensor parallelism is applied: torchtitan's apply_compile (then
                   apply_fsdp). Every block is its own compiled autograd node, so a block's
                   gradients are ready when its backward ends and its reduction overlaps the
                   blocks before it. Used for ZeRO-2/3, FSDP2 and tensor parallelism on both sides.
  + async TP       torch only (tp-sp-async): inductor's micro-pipelined TP
                   (torch._inductor.config._micro_pipeline_tp, symmetric memory on the TP group,
                   as torchtitan's _maybe_enable_async_tp) decomposes the sequence-parallel
                   all-gather / reduce-scatter around each matmul into overlapped pieces.

fullgraph is left off on both sides (torchtitan sets it for its own model code): a break is then
a slower row, not a failed one, and every row reports its graph breaks (dynamo's counters, reset
before each build), so a side that breaks shows it.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

WHOLE = "compile(model)"
BLOCKS = "compile(blocks)"
ASYNC_TP = "compile(blocks)+async TP"
EAGER = "eager"


def blocks_of(model) -> torch.nn.ModuleList:
    """The transformer blocks of an HF LlamaForCausalLM / GPT2LMHeadModel."""
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _options(backend: str, mode: Optional[str]) -> dict:
    """torch.compile's keywords: the backend, and the mode where one is asked for (None: torch's
    default; "reduce-overhead" replays each compiled graph as a CUDA graph, Megatron's per-layer
    CUDA graphs by another road)."""
    return dict(backend=backend) if mode in (None, "default") else dict(backend=backend, mode=mode)


def compile_blocks(model, backend: str, mode: Optional[str] = None):
    """torchtitan's apply_compile: module.compile() on each block, in place."""
    for block in blocks_of(model):
        block.compile(**_options(backend, mode))
    return model


def compile_model(model, backend: str, mode: Optional[str] = None):
    """nanoGPT's `model = torch.compile(model)` (an OptimizedModule that the wrapper takes)."""
    return torch.compile(model, **_options(backend, mode))


def blocks_if_compiled(ctx, model):
    """compile_blocks(model) where the side is built compiled (ctx.compiled), else the model."""
    return compile_blocks(model, ctx.args.compile_backend, ctx.args.compile_mode) if ctx.compiled else model


def model_if_compiled(ctx, model):
    """compile_model(model) where the side is built compiled, else the model."""
    return compile_model(model, ctx.args.compile_backend, ctx.args.compile_mode) if ctx.compiled else model


def recipe(ctx, compiled_as: str) -> str:
    """The table's name for how a side was built."""
    return compiled_as if ctx.compiled else EAGER


def reset() -> None:
    """Forget every compiled frame and the counters (once per side's build). Without it, a run of
    many rows piles cache entries onto the same block code (one per model and precision), and
    dynamo falls back to eager past its recompile limit."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()


def stats() -> dict:
    """Graph breaks and graphs dynamo captured since reset() (what the row reports)."""
    from torch._dynamo.utils import counters
    return dict(graph_breaks=int(sum(counters["graph_break"].values())),
                graphs=int(counters["stats"].get("unique_graphs", 0)))


def enable_async_tp(tp_group_name: str, device: torch.device) -> Callable[[], None]:
    """Turn on inductor's micro-pipelined TP for graphs compiled from now on; returns what turns
    it off again (the flag is process-wide: later rows must not inherit it)."""
    if device.type != "cuda":
        raise RuntimeError("tp-sp-async: torch's async TP needs CUDA symmetric memory (--device cuda)")
    # NOTE: the lent GPUs must never use NVLink multicast; symmetric memory would otherwise create
    # multicast objects where the driver offers them.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    enable_symm_mem_for_group(tp_group_name)
    previous = inductor_config._micro_pipeline_tp
    inductor_config._micro_pipeline_tp = True

    def close() -> None:
        inductor_config._micro_pipeline_tp = previous
    return close

