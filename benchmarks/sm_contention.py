"""How much each communication path takes from compute (issue 26): a GEMM-heavy stream runs beside
back-to-back collectives on another stream, and we report the GEMMs' slowdown against GEMMs
alone and the collectives' time against collectives alone, per path:

  nccl default        NCCL's kernels on an ordinary buffer (one CTA per channel)
  nccl maxCTAs=k      the same on a communicator made with maxCTAs k
  cta efficiency      CTAPolicy EFFICIENCY (NCCL >= 2.27)
  symmetric           the buffer in a symmetric window: NCCL's symmetric kernels
  rs + ce all-gather  all-reduce as a symmetric reduce-scatter + copy-engine all-gather
  all-gather default / all-gather copy engine   (ZeRO's gathers)

    torchrun --nproc_per_node 2 benchmarks/sm_contention.py --mib 25 100

Every rank runs the same number of collectives (fixed counts), so nothing waits on a peer that
stopped early. The header names each path's availability and, where it is off, why.
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pynccl  # noqa: E402
from ddp_bench_lib.levers import group_with_env  # noqa: E402
from pynccl.comm.symmetric import alloc_symmetric, symmetric_support  # noqa: E402

ENV_GROUPS = {  # communicators made while these PYNCCL_NCCL_* variables are set (comm_config.cpp)
    "nccl maxCTAs=4": {"PYNCCL_NCCL_MIN_CTAS": "1", "PYNCCL_NCCL_MAX_CTAS": "4"},
    "nccl maxCTAs=8": {"PYNCCL_NCCL_MIN_CTAS": "1", "PYNCCL_NCCL_MAX_CTAS": "8"},
    "cta efficiency": {"PYNCCL_NCCL_CTA_POLICY": "1"},
}


def _timed(fn, iters, stream):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
    return start, end


def _paths(numel, world_size, device):
    """name -> (callable enqueuing one collective on the current stream, or None, why-not)."""
    comm = pynccl.get_default_group().backend.comm
    plain = torch.ones(numel, device=device)
    paths = {"nccl default": (lambda: comm.all_reduce(plain, pynccl.ReduceOp.SUM), "")}
    for name, env in ENV_GROUPS.items():
        try:
            c = group_with_env(env).backend.comm
            buf = torch.ones(numel, device=device)
            paths[name] = (lambda c=c, buf=buf: c.all_reduce(buf, pynccl.ReduceOp.SUM), "")
        except ValueError as e:                            # e.g. CTAPolicy on an older NCCL
            paths[name] = (None, str(e))
    group = pynccl.get_default_group()
    support = symmetric_support(group)
    n = -(-numel // world_size) * world_size
    views = alloc_symmetric(group, [(n, torch.float32), (n, torch.float32)])
    if views is None:
        for name in ("symmetric", "rs + ce all-gather", "all-gather copy engine"):
            paths[name] = (None, support.reason)
    else:
        win, win2 = views
        win.fill_(1.0)
        k = n // world_size
        mine = win[group.backend.rank * k:(group.backend.rank + 1) * k]
        paths["symmetric"] = (lambda: comm.all_reduce(win, pynccl.ReduceOp.SUM), "")

        def rs_ag():
            comm.reduce_scatter_tensor(mine, win, pynccl.ReduceOp.SUM)
            comm.all_gather_into_tensor(win, mine)
        paths["rs + ce all-gather"] = (rs_ag, "" if support.copy_engine else "no copy engine: NCCL kernels gather")
        mine2 = win2[group.backend.rank * k:(group.backend.rank + 1) * k]
        paths["all-gather copy engine"] = (lambda: comm.all_gather_into_tensor(win2, mine2),
                                           "" if support.copy_engine else "no copy engine: NCCL kernels gather")
    full = torch.empty(n, device=device)
    part = torch.ones(n // world_size, device=device)
    paths["all-gather default"] = (lambda: comm.all_gather_into_tensor(full, part), "")
    return paths, support


def measure(args, device, world_size, rank):
    gemm_n = args.gemm
    a = torch.randn(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    b = torch.randn(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    out = torch.empty(gemm_n, gemm_n, device=device, dtype=torch.bfloat16)
    gemm = lambda: torch.mm(a, b, out=out)  # noqa: E731
    s_gemm, s_comm = torch.cuda.Stream(device), torch.cuda.Stream(device)
    for _ in range(5):
        gemm()
    torch.cuda.synchronize()
    st, en = _timed(gemm, args.gemms, s_gemm)
    torch.cuda.synchronize()
    gemm_alone = st.elapsed_time(en)
    rows = []
    for mib in args.mib:
        numel = int(mib * 2 ** 20) // 4
        paths, support = _paths(numel, world_size, device)
        for name, (fn, why) in paths.items():
            if fn is None:
                rows.append(dict(mib=mib, path=name, skipped=why))
                continue
            with torch.cuda.stream(s_comm):
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            st, en = _timed(fn, args.iters, s_comm)
            torch.cuda.synchronize()
            comm_alone = st.elapsed_time(en) / args.iters
            # NOTE: fixed counts on every rank: enough collectives to cover the GEMMs' time alone,
            # decided by rank 0 (its estimate) and broadcast, so the ranks pair up.
            count = torch.tensor([math.ceil(1.2 * gemm_alone / max(comm_alone, 1e-3)) + 2], device=device)
            pynccl.broadcast(count, 0)
            count = int(count.item())
            torch.cuda.synchronize()
            cs, ce = _timed(fn, count, s_comm)
            gs, ge = _timed(gemm, args.gemms, s_gemm)
            torch.cuda.synchronize()
            gemm_with = gs.elapsed_time(ge)
            comm_with = cs.elapsed_time(ce) / count
            rows.append(dict(mib=mib, path=name, note=why, comm_alone_ms=comm_alone, comm_with_ms=comm_with,
                             gemm_alone_ms=gemm_alone, gemm_with_ms=gemm_with,
                             gemm_slowdown=gemm_with / gemm_alone - 1))
        del paths
    return rows, support


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, nargs="+", default=[25.0, 100.0], help="collective sizes (fp32 MiB)")
    p.add_argument("--gemm", type=int, default=8192, help="bf16 GEMM size n (n x n x n)")
    p.add_argument("--gemms", type=int, default=40, help="GEMMs per timed window")
    p.add_argument("--iters", type=int, default=20, help="collectives timed alone")
    args = p.parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    pynccl.init_process_group("nccl")
    rows, support = measure(args, device, world_size, rank)
    if rank == 0:
        print(f"# SM contention: {args.gemms} bf16 GEMMs {args.gemm}^3 on one stream, collectives back to back on "
              f"another; {world_size} x {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"NCCL {pynccl.nccl_version()}; symmetric memory: {support.describe()}")
        print(f"{'MiB':>6} {'path':<24}{'comm alone ms':>14}{'comm w/ GEMM':>14}{'GEMM slowdown':>15}  note")
        for r in rows:
            if "skipped" in r:
                print(f"{r['mib']:>6g} {r['path']:<24}{'-':>14}{'-':>14}{'-':>15}  off: {r['skipped']}")
            else:
                print(f"{r['mib']:>6g} {r['path']:<24}{r['comm_alone_ms']:>14.3f}{r['comm_with_ms']:>14.3f}"
                      f"{100 * r['gemm_slowdown']:>14.1f}%  {r['note']}")
        print(f"# GEMMs alone: {rows[0].get('gemm_alone_ms', float('nan')):.2f} ms for {args.gemms}")
    pynccl.destroy_process_group()


if __name__ == "__main__":
    main()
