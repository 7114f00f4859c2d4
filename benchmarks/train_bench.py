"""Training, pynccl against the torch counterpart a user would pick, in one run: a Hugging Face
model config (random init, sizes by flags) trains --steps steps under a strategy, once with
pynccl and once with torch, from the same initial weights on the same data; one table row each:
tokens/s, step ms (median, min), peak memory, the loss after the last step, pynccl's step time
over torch's.

    torchrun --nproc_per_node 4 benchmarks/train_bench.py --strategy zero3,ddp        # ~1B Llama, bf16
    torchrun --nproc_per_node 4 benchmarks/train_bench.py --model hf-gpt2 --strategy zero1,zero2,zero3
    python benchmarks/train_bench.py --device cpu --nproc 2 --strategy ddp,zero3,pp-1f1b \\
        --hidden 64 --layers 4 --heads 4 --kv-heads 2 --intermediate 128 --vocab 128 --seq 32 --batch 4 --steps 3

Pairs (--strategy, a comma list or all):
  ddp                  pynccl.DistributedDataParallel  vs torch DDP                  (bf16 autocast)
  zero1|zero2|zero3    pynccl.FullyShardedDataParallel(stage=k) vs torch FSDP2 (fully_shard per block
                       + root); both MixedPrecision bf16 params, fp32 gradient reduction
  tp|tp-sp             pynccl.tensor_parallel.parallelize_module(plans.llama(sp)) vs DTensor
                       parallelize_module, torchtitan's Llama plan (tp = world size; bf16 autocast)
  pp-gpipe|pp-1f1b|pp-interleaved   pynccl.pipeline vs torch.distributed.pipelining, the same HF
                       stages (pynccl.pipeline.hf), --microbatches micro-batches (pp = world size;
                       interleaved: 2 stages per rank); with a -graphs suffix (pp-1f1b-graphs, ...),
                       pynccl's stages replay CUDA graphs (PipelineStage(cuda_graph=True)) against
                       torch's same schedule, eager
  tp2xdp2              pynccl TP (tp 2) + ZeRO-3 (dp world/2) vs DTensor TP + FSDP2 on a 2-D mesh
  tp-sp-async          (--compile only) pynccl TP+SP vs DTensor TP+SP with inductor's async TP
The torch side is the matching algorithm at its best (torch_runners.py): ZeRO-1 against DDP +
ZeroRedundancyOptimizer, ZeRO-2 against FSDP2 with reshard_after_forward=False, ZeRO-3 against FSDP2
wrapped as torchtitan wraps it (embedding, [norm, head] unresharded, each block, the root); tp at
one GPU against the plain model (TP scaling's reference).

--compile [on|both]: each side compiled as its users compile it (train_bench_lib/compile_recipes.py:
torch.compile(model) inside DDP for DDP and ZeRO-1, as nanoGPT; each block compiled before sharding
and after TP for the rest, as torchtitan); "both" adds the compiled rows to the eager ones. Each
build starts from a reset dynamo and its row reports the graph breaks; pipelines stay eager.
--batch is sequences per model replica (per data-parallel rank), so tokens/s counts the whole job:
batch × seq × dp / step time; tok/s/GPU divides by the world size, and MFU is torchtitan's
(train_bench_lib/mfu.py: (6·N + 12·L·H·D·T) flops per token × tok/s/GPU over the GPU's dense bf16
peak; n/a on an unknown GPU, on CPU and in fp32). Every step uses the same batch (per replica):
the loss falls, and the two sides' losses compare (equal in fp32, within bf16 noise in bf16); so do
a side's compiled and eager losses. Losses further apart than --loss-rtol are printed as PROBLEM.

--floor: after each pair (strategy, mode), rank 0 alone trains its no-communication floor while the
others wait (train_bench_lib/floor.py): for zero1/2/3 each side's own wrapper over a 1-rank group
(pynccl FullyShardedDataParallel; FSDP2 over a 1-rank DeviceMesh; DDP + ZeroRedundancyOptimizer),
for ddp and tp the plain model, built and compiled as the pair. The floor rows (layout 1) follow the
pair's; the summary prints per pair the floor, each side's cost over it and pynccl's cost over
torch's (cost_vs_torch), or for tp each side's step over the one-GPU step (scaling, target <= 0.6).

peak GiB: torch.cuda.max_memory_allocated over the steps plus the NCCL symmetric windows the side
holds outside torch's allocator (pynccl's ZeRO-3 gather ring, DDP/ZeRO-1/2 window buffers; listed
under the summary). --grad-ckpt: Hugging Face gradient checkpointing (gradient_checkpointing_enable)
on both sides, before wrapping.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

import pynccl  # noqa: E402
from pynccl.comm.symmetric import window_bytes  # noqa: E402
from train_bench_lib import (compile_recipes, floor, kernel_profile, mfu, pynccl_runners, report, timeline,  # noqa: E402
                             torch_runners)
from train_bench_lib.harness import free_device_memory, measure, pool  # noqa: E402
from train_bench_lib.models import (DEFAULTS, MODELS, STRATEGIES, BenchContext, hf_config,  # noqa: E402
                                    layout_of, num_params, parse_strategies, preload)

RUNNERS = {"pynccl": pynccl_runners.build, "torch": torch_runners.build, "plain": torch_runners.plain}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a Hugging Face model with pynccl and with torch, one row each.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--strategy", default="zero3", help="comma list of " + ", ".join(STRATEGIES) + ", or all (all but "
                   "the -graphs ones, which need CUDA, and tp-sp-async, which needs --compile)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="compile each side as its users do (on), or run eager and compiled rows (both)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (inductor; the CPU tests use aot_eager)")
    p.add_argument("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                   default="default", help="torch.compile mode, both sides and the floor alike (reduce-overhead: "
                   "each compiled graph replayed as a CUDA graph; inductor only)")
    p.add_argument("--loss-rtol", type=float, default=0.02,
                   help="final losses of a pair, or of a side compiled and eager, further apart are a PROBLEM")
    p.add_argument("--impl", choices=["both", "pynccl", "torch"], default="both")
    p.add_argument("--model", choices=MODELS, default="hf-llama")
    for name in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab", "seq"):
        p.add_argument(f"--{name}", type=int, default=None, help="default: the model's (see DEFAULTS)")
    p.add_argument("--batch", type=int, default=2, help="sequences per model replica (data-parallel rank)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (they train too)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each pair this many times, the two sides alternating; step times pooled over the runs")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline micro-batches per step")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--optim-impl", choices=["auto", "fused", "foreach", "for-loop"], default="auto",
                   help="AdamW implementation (auto: fused on GPU, foreach on CPU)")
    p.add_argument("--zero12-optim-impl", choices=["same", "fused", "foreach", "for-loop"], default="same",
                   help="AdamW of pynccl ZeRO stages 1/2 (default 'same': follows --optim-impl)")
    p.add_argument("--floor", action="store_true",
                   help="after each pair, rank 0 alone runs its no-communication floor at world size 1 "
                        "(zero*: each side's wrapper over a 1-rank group; ddp, tp: the plain model); the summary "
                        "adds each side's cost over it and their ratio, or TP's step over the one-GPU step")
    p.add_argument("--sp-dim", type=int, choices=[0, 1], default=1,
                   help="pynccl's tp-sp rows: the dim of the [b, s, h] activations sequence parallelism splits "
                        "(plans.llama's sequence_dim: 1 the sequence, as torchtitan's plan on the torch side; 0 the "
                        "batch, contiguous slabs: --batch must divide by the TP size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-ckpt", action="store_true",
                   help="HF gradient checkpointing (gradient_checkpointing_enable) on both sides, before wrapping")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--nproc", type=int, default=1, help="processes to spawn when not under torchrun")
    p.add_argument("--json", help="write the header and rows here (rank 0)")
    p.add_argument("--timeline", action="store_true",
                   help="pipeline pairs on GPU: after the timed steps, one step with every micro-batch's forward and "
                        "backward timed per rank (GPU and host), printed by rank 0")
    p.add_argument("--profile", action="store_true",
                   help="GPU: after each run's timed steps, two profiled steps; rank 0 prints its GPU time by kernel "
                        "category (train_bench_lib/kernel_profile.py)")
    p.add_argument("--profile-dump", help="needs --profile: rank 0 writes its profiled kernels here (JSON lines: "
                                          "name, stream, start and end in µs), one file per run (the run's label added)")
    p.add_argument("--plot", help="draw tokens/s per strategy here (PNG; rank 0)")
    args = p.parse_args(argv)
    if args.compile_mode != "default" and args.compile_backend != "inductor":
        p.error(f"--compile-mode {args.compile_mode} needs --compile-backend inductor (torch.compile's modes are "
                f"inductor's; {args.compile_backend} would ignore it)")
    if args.profile_dump and not args.profile:
        p.error("--profile-dump needs --profile (the dump is of the profiled steps)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:    # before the run, not after it
        p.error("--plot needs matplotlib, which is not installed in this Python environment: pip install matplotlib "
                "(or drop --plot)")
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model == "hf-llama" and args.kv_heads is None:
        args.kv_heads = args.heads
    args.strategies = parse_strategies(args.strategy)
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    args.modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    return args


def check_sizes(args, strategy: str, world_size: int) -> None:
    """Errors a run would otherwise hit deep inside a schedule, named up front."""
    layout = layout_of(strategy, world_size)
    if strategy.startswith("tp-sp") and args.sp_dim == 0 and args.batch % layout.tp:
        raise ValueError(f"{strategy} with --sp-dim 0: --batch {args.batch} is not divisible by tp ({layout.tp}); "
                         "the batch split needs it")
    if strategy.startswith("pp-"):
        v = 2 if strategy.startswith("pp-interleaved") else 1
        if args.layers < layout.pp * v:
            raise ValueError(f"{strategy}: {args.layers} layers cannot fill {layout.pp * v} stages")
        if args.batch % args.microbatches:
            raise ValueError(f"{strategy}: --batch {args.batch} is not divisible by --microbatches {args.microbatches}")
        if v > 1 and args.microbatches % layout.pp:
            raise ValueError(f"{strategy}: interleaved 1F1B needs --microbatches ({args.microbatches}) to be a "
                             f"multiple of pp ({layout.pp})")


def init_distributed(args) -> BenchContext:
    """torch.distributed first (torch's runners need it), then pynccl on the same store."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("train_bench: --device cuda needs GPUs (use --device cpu for a gloo run)")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")               # never NVLink multicast on lent GPUs
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # CPU tensors (the harness's timings and losses) go over gloo, CUDA tensors over NCCL.
        tdist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        pynccl.init_process_group("nccl", device_id=local_rank)
    else:
        device = torch.device("cpu")
        tdist.init_process_group("gloo")
        pynccl.init_process_group("gloo")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    return BenchContext(args, device, world_size, rank, dtype)


def header(ctx: BenchContext) -> dict:
    import transformers
    args = ctx.args
    try:
        nccl = ".".join(map(str, pynccl.nccl_version().runtime))
    except Exception as e:  # noqa: BLE001 - the extension may be missing on a CPU-only checkout
        nccl = f"n/a ({type(e).__name__})"
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    sizes = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq")}
    # MFU against the dense bf16 peak only means something for bf16 training on a known GPU.
    peak = mfu.peak_bf16_flops(gpu) if ctx.device.type == "cuda" and ctx.bf16 else None
    return dict(torch=torch.__version__, transformers=transformers.__version__, nccl_runtime=nccl,
                torch_nccl=torch_runners.torch_nccl_version(), device=gpu, world_size=ctx.world_size,
                flops_per_token=mfu.hf_flops_per_token(hf_config(args), args.seq), peak_bf16_flops=peak,
                compile=args.compile, compile_backend=args.compile_backend, compile_mode=args.compile_mode, floor=args.floor,
                model=args.model, params=num_params(hf_config(args)), batch=args.batch, steps=args.steps,
                warmup=args.warmup, microbatches=args.microbatches, dtype=args.dtype, optim=args.optim_impl,
                sp_dim=args.sp_dim,
                zero12_optim=args.optim_impl if args.zero12_optim_impl == "same" else args.zero12_optim_impl, **sizes)


def print_header(h: dict) -> None:
    print(f"# train_bench: {h['model']} {h['params'] / 1e6:.4g}M params (hidden {h['hidden']}, {h['layers']} layers, "
          f"{h['heads']} heads, kv {h['kv_heads']}, ffn {h['intermediate']}, vocab {h['vocab']}), seq {h['seq']}, "
          f"batch {h['batch']}/replica, {h['dtype']}, AdamW {h['optim']}, {h['warmup']}+{h['steps']} steps"
          + ("; pynccl's sequence parallelism splits the batch (--sp-dim 0)" if h.get("sp_dim") == 0 else ""))
    print(f"# {h['world_size']} × {h['device']}; torch {h['torch']} (NCCL {h['torch_nccl']}), pynccl NCCL runtime "
          f"{h['nccl_runtime']}, transformers {h['transformers']}")
    peak = "n/a" if h["peak_bf16_flops"] is None else f"{h['peak_bf16_flops'] / 1e12:.0f} TFLOP/s"
    print(f"# MFU: {h['flops_per_token'] / 1e9:.3f} GFLOP per token (6·N + 12·L·H·D·T) over the dense bf16 peak "
          f"({peak}); compile: {h['compile']} (backend {h['compile_backend']}, mode {h.get('compile_mode', 'default')})")


def run_one(ctx: BenchContext, strategy: str, impl: str) -> dict:
    layout = layout_of(strategy, ctx.world_size)
    row = dict(strategy=strategy, impl=impl, layout=str(layout), compiled=ctx.compiled,
               recipe=compile_recipes.EAGER, runs=report.runs_as(strategy, impl, str(layout)))
    trainer = None
    try:
        check_sizes(ctx.args, strategy, ctx.world_size)
        if ctx.compiled and strategy.startswith("pp-"):
            raise ValueError("no compiled recipe for pipelines (eager only)")
        if ctx.compiled:
            compile_recipes.reset()
        free_device_memory(ctx)
        base = torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
        base_windows = window_bytes()
        trainer = RUNNERS[impl](strategy, ctx)
        row["recipe"] = trainer.recipe
        free_device_memory(ctx)            # what the build left behind (a whole model before sharding)
        row.update(measure(trainer, ctx, ctx.args.batch * ctx.args.seq * layout.dp, base, base_windows))
        if ctx.compiled:
            row.update(compile_recipes.stats())
        if ctx.args.profile and ctx.device.type == "cuda":
            label = f"{strategy} {impl} {'compiled' if ctx.compiled else 'eager'} world {ctx.world_size}"
            row["profile"] = kernel_profile.profile_and_print(trainer, ctx, label)
        if ctx.args.timeline and trainer.instrument is not None and ctx.device.type == "cuda":
            tl = timeline.Timeline()
            trainer.instrument(tl)
            timeline.run_and_print(trainer, tl, ctx, f"{strategy} {report.runs_as(strategy, impl)}")
    except Exception as e:  # noqa: BLE001 - a failing pair must not stop the others
        if ctx.rank == 0:
            traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if trainer is not None and trainer.close is not None:
        trainer.close()
    del trainer
    free_device_memory(ctx)
    return row


def add_throughput(row: dict, world_size: int, h: dict) -> dict:
    """tokens/s per GPU and MFU of a (pooled) row."""
    if not row.get("error"):
        row["tokens_per_s_gpu"] = row["tokens_per_s"] / world_size
        row["mfu"] = mfu.mfu(h["flops_per_token"], row["tokens_per_s_gpu"], h["peak_bf16_flops"])
    return row


def worker(rank, world_size, args):
    ctx = init_distributed(args)
    impls = report.IMPLS if args.impl == "both" else (args.impl,)
    h = header(ctx)
    if ctx.rank == 0:
        print_header(h)
        print(report.HEADER, flush=True)
    rows = []
    groups = floor.make_groups() if args.floor else None     # collective: every rank, once
    if ctx.rank == 0 and args.floor:
        none = [s for s in args.strategies if not floor.sides(s)]
        if none:
            print(f"# floor: none for {', '.join(none)} (a rank's share of a pipeline or a 2-D mesh is not a "
                  f"world-size-1 run)", flush=True)
    for strategy in args.strategies:
        for compiled in args.modes:
            if strategy.endswith("-async") and not compiled and len(args.modes) > 1:
                continue                               # --compile both: async TP has no eager row
            mode_ctx = dataclasses.replace(ctx, compiled=compiled)
            runs = {impl: [] for impl in impls}
            for _ in range(args.repeats):              # the sides alternate, so drift hits both alike
                for impl in impls:
                    runs[impl].append(run_one(mode_ctx, strategy, impl))
                    if ctx.rank == 0 and args.repeats > 1:
                        print("# run: " + report.format_row(runs[impl][-1]), flush=True)
            for impl in impls:
                rows.append(add_throughput(pool(runs[impl]), ctx.world_size, h))
                if ctx.rank == 0:
                    print(report.format_row(rows[-1]), flush=True)
            if args.floor:
                for row in floor.run(mode_ctx, strategy, groups, run_one, args.repeats):
                    rows.append(add_throughput(row, 1, h))
                    print(report.format_row(row), flush=True)          # rank 0 only has floor rows
    report.add_ratios(rows)
    if ctx.rank == 0:
        print("\n# summary (ms vs torch: pynccl's median step time over torch's, same mode; wall ms: the timed "
              "steps' wall time / steps, barrier to barrier; breaks: graph breaks while compiling)")
        report.print_table(rows)
        for line in report.floor_lines(rows):
            print(line)
        for line in report.window_notes(rows):
            print(line)
        for line in report.loss_problems(rows, args.loss_rtol):
            print("PROBLEM:", line)
        if args.json:
            report.write_json(args.json, h, rows)
        if args.plot:
            report.plot(args.plot, f"{h['model']} {h['params'] / 1e6:.4g}M, {h['world_size']} × {h['device']}, "
                        f"{h['dtype']}", rows)
    tdist.barrier()
    pynccl.destroy_process_group()
    if tdist.is_initialized():
        tdist.destroy_process_group()
    return rows


def main(argv=None):
    args = parse_args(argv)
    preload()
    if "RANK" in os.environ:                      # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    from pynccl.testing import run_multiprocess
    run_multiprocess(worker, args.nproc, backend=None, timeout=3600, args=(args,),
                     start_method="spawn" if args.device == "cuda" else None)


if __name__ == "__main__":
    main()
