"""The overlapped TP ops of pynccl/tensor_parallel/async_tp.py against the same work done in sequence
(the collective, then the GEMMs) and against the GEMMs alone (no communication: the floor), in one
run, forward and forward + backward, per Llama block shape. Run with torchrun, one process per GPU:

    torchrun --nproc_per_node 2 benchmarks/async_tp_ops.py [--batch 4 --seq 2048 --hidden 2048 ...]

Prints per case: GPU time per call (CUDA events, median of --repeats windows of --iters calls),
the host time per call (the launch loop's wall time / calls, no synchronisation inside), and the
ratios to the sequential composition and to the floor. The overlapped ops run twice: with the
chunks moved by NCCL's kernels (`ring`: PYNCCL_TP_ASYNC_SUM=all_reduce) and through the group's
symmetric window (`window`: gather; on the copy engines where the group has them), then the Python
reference. --sp-dim 0 splits the batch instead of the sequence (train_bench's --sp-dim).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import pynccl
from pynccl.comm import functional_collectives as fc
from pynccl.comm.symmetric import symmetric_support
from pynccl.tensor_parallel import async_tp
from pynccl.tensor_parallel.async_tp_allreduce import SUM_ENV


def _time(fn, iters, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(repeats):
        pynccl.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        host.append((time.perf_counter() - t0) / iters * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / iters)
    return statistics.median(gpu), statistics.median(host)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sp-dim", type=int, choices=(0, 1), default=1,
                    help="the dim a rank's chunk is cut along: 1 the sequence (default), 0 the batch")
    args = ap.parse_args()
    pynccl.init_process_group("nccl")
    group = pynccl.get_default_group()
    n, rank = group.world_size, group.group_rank
    torch.cuda.set_device(pynccl.get_device(group))
    dev, dt = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    b, s, h = args.batch, args.seq, args.hidden
    d = args.sp_dim
    if (b, s)[d] % n:
        ap.error(f"--sp-dim {d}: the {'batch' if d == 0 else 'sequence'} ({(b, s)[d]}) must divide by {n} ranks")
    local = (b // n, s) if d == 0 else (b, s // n)

    def whole(t):   # (b, s, ..) from the rank-major gather along dim 0 of the chunk made dim 0
        return t if d == 0 else t.transpose(0, 1)

    def rank_major(t):
        return t.contiguous() if d == 0 else t.transpose(0, 1).contiguous()
    head_dim = h // args.heads
    gen = torch.Generator(device=dev).manual_seed(rank)

    def rnd(*shape, grad=False):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen).div_(shape[-1] ** 0.5).requires_grad_(grad)

    cases = {  # name: (readers' output widths, or the row-parallel input width)
        "attn qkv (gather)": ("gather", [args.heads * head_dim // n, 2 * args.kv_heads * head_dim // n]),
        "mlp gate/up (gather)": ("gather", [args.intermediate // n, args.intermediate // n]),
        "attn o_proj (scatter)": ("scatter", args.heads * head_dim // n),
        "mlp down (scatter)": ("scatter", args.intermediate // n),
    }
    support = symmetric_support(group)
    if rank == 0:
        if not support.available:   # then scratch_window gives None and the C++ ops take NCCL's kernels
            print(f"# no symmetric window ({support.reason}): the window column runs NCCL's kernels too")
        print(f"# async_tp_ops: {n} × {torch.cuda.get_device_name()}; torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}; batch {b}, seq {s}, hidden {h}, bf16, chunks along "
              f"{'the batch' if d == 0 else 'the sequence'}; "
              f"{args.iters} calls × {args.repeats} windows, GPU ms per call (host ms per call)")
        print(f"{'case':24} {'pass':8} {'floor':>14} {'sequential':>14} {'ring':>14} {'window':>14} "
              f"{'ring/seq':>8} {'win/seq':>8} {'win/floor':>9} {'python ref':>14}")
    for name, (kind, widths) in cases.items():
        for passes in ("fwd", "fwd+bwd"):
            bwd = passes == "fwd+bwd"
            if kind == "gather":
                x = rnd(*local, h, grad=bwd)
                ws = [rnd(w, h, grad=bwd) for w in widths]
                x_whole = rnd(b, s, h, grad=bwd)

                def floor():
                    ys = [F.linear(x_whole, w) for w in ws]
                    if bwd:
                        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])

                def sequential():
                    full = whole(fc.all_gather(rank_major(x), group))
                    ys = [F.linear(full, w) for w in ws]
                    if bwd:   # the plain path: grads summed by a reduce-scatter after the GEMMs
                        gs = [torch.ones_like(y) for y in ys]
                        gx = sum(g @ w for g, w in zip(gs, ws))
                        fc.reduce_scatter(rank_major(gx), group)
                        for g, w in zip(gs, ws):
                            g.reshape(-1, g.shape[-1]).t() @ full.reshape(-1, h)

                def overlapped():
                    _, ys = async_tp.gather_linears(x, ws, group, d)
                    if bwd:
                        torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
            else:
                hh = rnd(b, s, widths, grad=bwd)
                w = rnd(h, widths, grad=bwd)

                def floor():
                    y = F.linear(hh, w)
                    if bwd:
                        y.backward(torch.ones_like(y))

                def sequential():
                    y = F.linear(hh, w)
                    out = fc.reduce_scatter(rank_major(y), group)
                    if bwd:
                        g = whole(fc.all_gather(torch.ones_like(out), group))
                        g @ w
                        g.reshape(-1, h).t() @ hh.reshape(-1, widths)

                def overlapped():
                    y = async_tp.linear_reduce_scatter(hh, w, group, d)
                    if bwd:
                        y.backward(torch.ones_like(y))
            with torch.no_grad() if not bwd else torch.enable_grad():
                results = {k: _time(f, args.iters, args.repeats) for k, f in
                           (("floor", floor), ("sequential", sequential))}
                before = os.environ.get(SUM_ENV)
                for mode, label in (("all_reduce", "ring"), ("gather", "window")):
                    os.environ[SUM_ENV] = mode
                    try:
                        results[label] = _time(overlapped, args.iters, args.repeats)
                    finally:
                        os.environ.pop(SUM_ENV, None)
                        if before is not None:
                            os.environ[SUM_ENV] = before
                native = async_tp.native
                async_tp.native = lambda g, name: None   # the Python reference of the same ops
                try:
                    results["python"] = _time(overlapped, args.iters, args.repeats)
                finally:
                    async_tp.native = native
            if rank == 0:
                cell = {k: f"{g:6.3f} ({hst:5.3f})" for k, (g, hst) in results.items()}
                print(f"{name:24} {passes:8} {cell['floor']:>14} {cell['sequential']:>14} {cell['ring']:>14} "
                      f"{cell['window']:>14} {results['ring'][0] / results['sequential'][0]:8.3f} "
                      f"{results['window'][0] / results['sequential'][0]:8.3f} "
                      f"{results['window'][0] / results['floor'][0]:9.3f} {cell['python']:>14}", flush=True)
    pynccl.destroy_process_group()


if __name__ == "__main__":
    main()
