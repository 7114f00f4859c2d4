#!/usr/bin/env bash
# One device call on a multi-GPU machine, in priority order within a wall-clock budget:
# build, the multigpu tests named in TESTS, ddp_bench at N ranks, the collective sweep (eager
# and -G, 8 B to BENCH_MAX), zero_bench, tp_bench, pp_bench. Each step gets min(its cap, what is
# left); logs go to OUTDIR.
#   BUDGET=590 benchmarks/run_multi_gpu_session.sh OUTDIR
set -uo pipefail
O=${1:?usage: run_multi_gpu_session.sh OUTDIR}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-590}
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
step() {  # step NAME CAP cmd...: runs cmd with min(CAP, time left) seconds, log in $O/NAME.log
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 20 ]; then echo "=== $name: skipped (no time left)"; return; fi
  local t0=$SECONDS
  timeout "$cap" "$@" >"$O/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s (cap $cap)"
}
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" >"$O/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$O/versions.txt"
step build 90 python3 -m pip install --no-build-isolation --no-deps -e .
step tests 240 python3 -m pytest -rA -p no:cacheprovider -m multigpu ${TESTS:-tests}
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$O/tests.log"
step ddp_bench 120 torchrun --nproc_per_node "$N" benchmarks/ddp_bench.py --repeats 3 --json "$O/ddp_bench.json"
head -16 "$O/ddp_bench.log"
BENCH_ITERS=${BENCH_ITERS:-10} BENCH_WARMUP=${BENCH_WARMUP:-3} BENCH_SKIP_CPUTIME=1 \
  step sweep 240 benchmarks/run_multi_gpu.sh "$O/sweep" "$N"
sed -n '/== summary/,$p' "$O/sweep.log"
step zero_bench 70 torchrun --nproc_per_node "$N" benchmarks/zero_bench.py
tail -12 "$O/zero_bench.log"
step tp_bench 50 torchrun --nproc_per_node "$N" benchmarks/tp_bench.py
tail -8 "$O/tp_bench.log"
step pp_bench 60 python3 benchmarks/pp_bench.py --backend nccl --nproc "$N"
tail -8 "$O/pp_bench.log"
step zero_memory 60 torchrun --nproc_per_node "$N" benchmarks/zero_memory.py --device cuda
sed -n '1,20p' "$O/zero_memory.log"
step ddp_bench2 90 torchrun --nproc_per_node 2 benchmarks/ddp_bench.py --repeats 3
head -14 "$O/ddp_bench2.log"
