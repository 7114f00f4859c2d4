#!/usr/bin/env bash
# The whole GPU session in two phases, for the device machine (one GPU or several):
#   benchmarks/run_gpu_suite.sh tests OUTDIR   build, every gpu/multigpu test, host overhead
#   benchmarks/run_gpu_suite.sh bench OUTDIR   every benchmark (collectives, DDP, ZeRO, TP, PP, examples)
# Logs go to OUTDIR; the device tool brings back $OUT, so OUTDIR is usually $OUT/...
set -uo pipefail
PHASE=${1:?usage: run_gpu_suite.sh tests|bench OUTDIR}
OUTDIR=${2:?usage: run_gpu_suite.sh tests|bench OUTDIR}
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$(date +%s)
        timeout "${STEP_TIMEOUT:-400}" "$@" >"$OUTDIR/$name.log" 2>&1; local rc=$?
        echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n "${TAIL:-25}" "$OUTDIR/$name.log"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"; } \
  >"$OUTDIR/versions.txt" 2>&1
cat "$OUTDIR/versions.txt"
if [ "$PHASE" = tests ]; then
  run build python3 -m pip install -v --no-build-isolation --no-deps -e .
  grep "pynccl:" "$OUTDIR/build.log"
  python3 -c "import pynccl; print(pynccl.nccl_version())" || exit 1
  run gpu_tests python3 -m pytest -q -rs -m "gpu or multigpu" -p no:cacheprovider tests
  run host_overhead python3 benchmarks/host_overhead.py
  run check_cost python3 benchmarks/collective_check_cost.py --backend nccl --nproc "$NGPU" --iters 2000
else
  python3 -m pip install --no-build-isolation --no-deps -e . >"$OUTDIR/build.log" 2>&1
  python3 -c "import pynccl; print(pynccl.nccl_version())" || exit 1
  if [ "$NGPU" = 1 ]; then
    run bench_collectives benchmarks/run_single_gpu.sh "$OUTDIR/bench"
  else
    run bench_collectives benchmarks/run_multi_gpu.sh "$OUTDIR/bench" "$NGPU"
  fi
  L="torchrun --nproc_per_node $NGPU"
  run ddp_bench $L benchmarks/ddp_bench.py --json "$OUTDIR/ddp_bench.json"
  run zero_bench $L benchmarks/zero_bench.py --json "$OUTDIR/zero_bench.json"
  run zero_memory $L benchmarks/zero_memory.py --device cuda
  run tp_bench $L benchmarks/tp_bench.py
  run tp_bench_small $L benchmarks/tp_bench.py --hidden 768 --heads 12
  run pp_bench python3 benchmarks/pp_bench.py --backend nccl --nproc "$NGPU"
  run train_ddp $L examples/train_ddp.py --epochs 2
  run train_gpt $L examples/train_gpt.py --steps 200
fi
