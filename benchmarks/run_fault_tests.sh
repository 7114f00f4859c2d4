#!/usr/bin/env bash
# Issue 20 on a 4-GPU machine: the NCCL fault tests (tests/test_faults_gpu.py, one process per GPU,
# 10 s group timeout) at world size 4, the one-GPU time-out tests, and the host time per call at
# one GPU (benchmarks/host_overhead.py; compare with RESULTS.md's previous figure).
#   benchmarks/run_fault_tests.sh OUTDIR        (exit status: non-zero if any part failed)
# Builds the extension in place first (setup.py build_ext --inplace; SKIP_BUILD=1 skips it). Logs: OUTDIR/faults4.log
# (seconds per survivor: OUTDIR/fault_times.jsonl), OUTDIR/single_gpu_timeouts.log,
# OUTDIR/host_overhead.log (+ .json). About 5 minutes on 4 GPUs.
set -uo pipefail
OUTDIR=${1:?usage: run_fault_tests.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset PYNCCL_ON_TIMEOUT PYNCCL_NCCL_NONBLOCKING
PY=${PYTHON:-python3}
status=0
rm -f "$OUTDIR/fault_times.jsonl"
if [ "${SKIP_BUILD:-0}" != 1 ]; then  # the extension of this tree (SKIP_BUILD=1: already built)
  MAX_JOBS=${MAX_JOBS:-32} "$PY" setup.py build_ext --inplace >"$OUTDIR/build.log" 2>&1 \
    || { echo "build failed: $OUTDIR/build.log"; tail -30 "$OUTDIR/build.log"; exit 1; }
fi

t0=$SECONDS
FAULT_WORLD_SIZE=${FAULT_WORLD_SIZE:-4} FAULT_TIMES_FILE="$OUTDIR/fault_times.jsonl" \
  timeout 420 "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_faults_gpu.py >"$OUTDIR/faults4.log" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
echo "== fault tests: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUTDIR/faults4.log"

t0=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 300 "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_nccl_timeouts_lifecycle.py \
  -k "timeout or abort or destroy or self_recv or split" >"$OUTDIR/single_gpu_timeouts.log" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
echo "== single-GPU time-out tests: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUTDIR/single_gpu_timeouts.log"

CUDA_VISIBLE_DEVICES=0 timeout 300 "$PY" benchmarks/host_overhead.py --json "$OUTDIR/host_overhead.json" \
  >"$OUTDIR/host_overhead.log" 2>&1 || status=1

for f in faults4.log single_gpu_timeouts.log; do
  echo "=== $f"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|passed|failed|^== " "$OUTDIR/$f" | tail -25
done
echo "=== seconds per survivor (case, mode, world size, {rank: s})"
cat "$OUTDIR/fault_times.jsonl" 2>/dev/null
echo "=== host_overhead"; tail -15 "$OUTDIR/host_overhead.log"
exit $status
