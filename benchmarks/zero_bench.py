"""ZeRO stages 1-3 against pynccl DDP: step time and peak memory per rank on a GPT-2-small-sized
model (124M parameters, the model of ddp_bench.py), in one run.

    python benchmarks/zero_bench.py                          # one GPU, world size 1
    python benchmarks/zero_bench.py --nproc 4                # 4 GPUs, processes spawned here
    torchrun --nproc_per_node 8 benchmarks/zero_bench.py     # or under torchrun
    python benchmarks/zero_bench.py --device cpu --tiny --nproc 2    # gloo smoke run

Precision (default bf16): DDP runs bf16 autocast over fp32 parameters (gradients all-reduced
in fp32); ZeRO runs MixedPrecision(param_dtype=bf16, reduce_dtype=fp32) over fp32 master
shards, so both reduce fp32 gradients. --precision fp32 runs both in plain fp32. Every mode
uses AdamW(fused=True) on CUDA and the same fixed synthetic batch; modes run one after the
other (each alone on the GPU, so its peak memory is its own), steps timed with CUDA events.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import pynccl  # noqa: E402
from ddp_bench import GPT  # noqa: E402
from pynccl.zero import MixedPrecision  # noqa: E402

MODES = ["no wrapper", "pynccl DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
TINY = dict(vocab=512, ctx=64, d=64, layers=2, heads=4)


def build(mode, args, device):
    """(model, optimizer, autocast?) for one mode; None when the mode cannot run here."""
    torch.manual_seed(0)
    net = GPT(**(TINY if args.tiny else {})).to(device)
    bf16 = args.precision == "bf16"
    if mode == "pynccl DDP":
        try:
            net = pynccl.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
        except (AttributeError, ImportError) as e:
            print(f"# skipping pynccl DDP: {e}")
            return None
    elif mode.startswith("ZeRO"):
        mp = MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
        net = pynccl.FullyShardedDataParallel(net, stage=int(mode[-1]), mixed_precision=mp,
                                              bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(net.parameters(), lr=6e-4, fused=device.type == "cuda")
    autocast = bf16 and not mode.startswith("ZeRO")     # ZeRO computes in bf16 parameters already
    return net, opt, autocast


def step(model, opt, autocast, batch, device):
    x, y = batch
    with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    if isinstance(model, pynccl.FullyShardedDataParallel):
        model.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_mode(mode, args, device, batch):
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    built = build(mode, args, device)
    if built is None:
        return None
    model, opt, autocast = built
    num_params = sum(p.numel() for p in model.parameters())
    for _ in range(args.warmup):
        step(model, opt, autocast, batch, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        for _ in range(args.steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(model, opt, autocast, batch, device)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                step(model, opt, autocast, batch, device)
                times.append(1e3 * (time.perf_counter() - t0))
    out = dict(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times), n=len(times),
               params_this_rank=num_params)
    if cuda:
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    if isinstance(model, pynccl.FullyShardedDataParallel):
        out["model_state_mib"] = model.memory_bytes(opt)["total"] / 2 ** 20
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def worker(rank, world_size, args):
    device = pynccl.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    vocab, ctx = (TINY["vocab"], TINY["ctx"]) if args.tiny else (50257, 1024)
    seq = min(args.seq, ctx)
    g = torch.Generator().manual_seed(1 + rank)
    batch = tuple(torch.randint(0, vocab, (args.batch, seq), generator=g).to(device) for _ in range(2))
    result = dict(world_size=world_size, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, precision=args.precision, batch=args.batch, seq=seq, modes={})
    for mode in MODES:
        if mode not in args.skip:
            r = time_mode(mode, args, device, batch)
            if r is not None:
                result["modes"][mode] = r
    return result


def print_report(r):
    print(f"# ZeRO vs DDP: GPT-2 small{' (tiny)' if r.get('tiny') else ''}, batch {r['batch']}x{r['seq']} tokens "
          f"per rank, {r['precision']}, world size {r['world_size']}, {r['device']}, torch {r['torch']}")
    print(f"{'mode':<12}{'median ms':>11}{'min':>9}{'max':>9}{'vs DDP':>8}{'peak MiB':>10}{'states MiB':>12}"
          f"{'params/rank':>13}")
    ddp = r["modes"].get("pynccl DDP", {}).get("median_ms")
    for m, s in r["modes"].items():
        ratio = f"{s['median_ms'] / ddp:.2f}" if ddp else "-"
        peak = f"{s['peak_mib']:.0f}" if "peak_mib" in s else "-"
        states = f"{s['model_state_mib']:.0f}" if "model_state_mib" in s else "-"
        print(f"{m:<12}{s['median_ms']:>11.2f}{s['min_ms']:>9.2f}{s['max_ms']:>9.2f}{ratio:>8}{peak:>10}{states:>12}"
              f"{s['params_this_rank']:>13,}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d=64 GPT (smoke runs on CPU)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=MODES)
    p.add_argument("--nproc", type=int, default=1, help="processes to spawn when not under torchrun")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("zero_bench: --device cuda needs GPUs (use --device cpu --tiny for a gloo run)")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if "RANK" in os.environ:                            # torchrun
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
        pynccl.init_process_group(backend, device_id=local_rank if args.device == "cuda" else None)
        result = worker(pynccl.get_rank(), pynccl.get_world_size(), args)
        pynccl.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    else:
        from pynccl.testing import run_multiprocess
        result = run_multiprocess(worker, args.nproc, backend=backend, timeout=1800, args=(args,),
                                  start_method="spawn" if args.device == "cuda" else None)[0]
    result["tiny"] = args.tiny
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
