#!/usr/bin/env bash
# Every op on one GPU (world size 1, NCCL), 8 B to 1 GiB, pynccl and torch.distributed side by
# side: eager, CUDA graph (-G) and host-overhead (-C) runs, text + JSON + plots in OUTDIR.
#   benchmarks/run_single_gpu.sh OUTDIR          (about 2-3 minutes on one H200)
# NOTE: at world size 1 even 1 GiB takes under 1 ms per op, so 50 timed iterations and the median
# of 3 repetitions (pynccl and torch alternating) cost seconds and steady the few-us small sizes.
set -uo pipefail
OUT=${1:?usage: benchmarks/run_single_gpu.sh OUTDIR}
BENCH_MAX=1G BENCH_CPU_MAX=1G BENCH_ITERS=50 BENCH_REPS=3 exec "$(dirname "$0")/run_multi_gpu.sh" "$OUT" 1
