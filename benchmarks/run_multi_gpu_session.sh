#!/usr/bin/env bash
# Multi-GPU device calls in two phases, each within a wall-clock budget; steps run in priority
# order, each with min(its cap, what is left); logs go to OUTDIR.
#   BUDGET=580 benchmarks/run_multi_gpu_session.sh a OUTDIR   build, every multigpu test at N GPUs and
#                                                            at 2 side by side, ddp_bench at N and at 2
#   BUDGET=500 benchmarks/run_multi_gpu_session.sh b OUTDIR   ddp_bench's stream-priority A/B at N, pp_bench,
#                                                            zero_memory at N, the collective sweep (eager
#                                                            and -G, 8 B to BENCH_MAX)
set -uo pipefail
PHASE=${1:?usage: run_multi_gpu_session.sh a|b OUTDIR}
O=${2:?usage: run_multi_gpu_session.sh a|b OUTDIR}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-580}
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
if [ "$PHASE" = a ]; then
  TEST_TIMEOUT=${TEST_TIMEOUT:-315} step tests "${TESTS_CAP:-330}" benchmarks/run_multigpu_tests.sh "$O"
  for f in "$O"/multigpu*.log; do echo "--- $f"; grep -E " (PASSED|FAILED|ERROR)|passed|failed|== exit" "$f"; done
  step ddp_bench 100 torchrun --nproc_per_node "$N" benchmarks/ddp_bench.py --repeats 3 --json "$O/ddp_bench.json"
  grep -v "^# \[" "$O/ddp_bench.log" | head -14
  step ddp_bench2 80 torchrun --nproc_per_node 2 benchmarks/ddp_bench.py --repeats 3 --json "$O/ddp_bench2.json"
  grep -v "^# \[" "$O/ddp_bench2.log" | head -14
else
  step ddp_prio 80 torchrun --nproc_per_node "$N" benchmarks/ddp_bench.py --compare-priority --repeats 4 \
    --json "$O/ddp_prio.json"
  grep -v "^# \[" "$O/ddp_prio.log" | grep -v "^W1" | head -18
  step pp_bench 60 python3 benchmarks/pp_bench.py --backend nccl --nproc "$N"
  tail -8 "$O/pp_bench.log"
  step zero_memory 70 torchrun --nproc_per_node "$N" benchmarks/zero_memory.py --device cuda
  sed -n '1,22p' "$O/zero_memory.log"
  BENCH_MAX=${BENCH_MAX:-1G} BENCH_ITERS=${BENCH_ITERS:-20} BENCH_WARMUP=${BENCH_WARMUP:-5} BENCH_REPS=${BENCH_REPS:-3} \
    BENCH_SKIP_CPUTIME=1 step sweep "${SWEEP_CAP:-300}" benchmarks/run_multi_gpu.sh "$O/sweep" "$N"
  sed -n '/== summary/,$p' "$O/sweep.log"
fi
