#!/usr/bin/env bash
# Every GPU test of the suite on a machine with 4 GPUs, in about 8 minutes: the `gpu` tests on GPU 0
# while the `multigpu` tests run at 2 GPUs on GPUs 2,3; then the `multigpu` tests at 4 GPUs.
# Logs: OUTDIR/gpu1.log, OUTDIR/multigpu2.log, OUTDIR/multigpu4.log (each ends with "== exit RC after S s").
#   benchmarks/run_gpu_tests.sh OUTDIR            (TEST_TIMEOUT=330 s per pytest run by default)
set -uo pipefail
O=${1:?usage: run_gpu_tests.sh OUTDIR}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
T=${TEST_TIMEOUT:-330}
PYTEST=(python3 -m pytest -v -rA -p no:cacheprovider tests)
run() {  # run LOG DEVICES MARKER
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$2 timeout -k 10 "$T" "${PYTEST[@]}" -m "$3" >"$O/$1" 2>&1
  echo "== exit $? after $((SECONDS - t0)) s" >>"$O/$1"
}
run gpu1.log 0 gpu &
run multigpu2.log 2,3 multigpu &
wait
run multigpu4.log 0,1,2,3 multigpu
rc=0
for f in gpu1.log multigpu2.log multigpu4.log; do
  echo "=== $f"; grep -E "^(FAILED|ERROR)|passed|failed|== exit" "$O/$f" | tail -12
  grep -q "== exit 0 after" "$O/$f" || rc=1
done
exit $rc
