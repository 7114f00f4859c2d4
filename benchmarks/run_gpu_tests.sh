#!/usr/bin/env bash
# Every GPU test of the suite on a machine with 4 GPUs, in about 15 minutes (more than one device call
# allows: run it with STAGE=a, then STAGE=b): the `gpu` tests on GPU 0 while the `multigpu` tests run
# at 2 GPUs on GPUs 2,3 (a: over 5.5 min since the fault tests joined); then the `multigpu` tests at 4 GPUs
# (b: 18 of its 26 tests took 340 s in session 5, so about 9 min).
# Logs: OUTDIR/gpu1.log, OUTDIR/multigpu2.log, OUTDIR/multigpu4.log (each ends with "== exit RC after S s").
#   [STAGE=a|b] benchmarks/run_gpu_tests.sh OUTDIR     (TEST_TIMEOUT=540 s per pytest run by default)
set -uo pipefail
O=${1:?usage: run_gpu_tests.sh OUTDIR}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
T=${TEST_TIMEOUT:-540}
STAGE=${STAGE:-ab}
PYTEST=(python3 -m pytest -v -rA -p no:cacheprovider tests)
run() {  # run LOG DEVICES MARKER
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$2 timeout -k 10 "$T" "${PYTEST[@]}" -m "$3" >"$O/$1" 2>&1
  echo "== exit $? after $((SECONDS - t0)) s" >>"$O/$1"
}
logs=()
if [[ $STAGE == *a* ]]; then
  run gpu1.log 0 gpu &
  run multigpu2.log 2,3 multigpu &
  wait
  logs+=(gpu1.log multigpu2.log)
fi
if [[ $STAGE == *b* ]]; then
  run multigpu4.log 0,1,2,3 multigpu
  logs+=(multigpu4.log)
fi
rc=0
for f in "${logs[@]}"; do
  echo "=== $f"; grep -E "^(FAILED|ERROR)|passed|failed|== exit" "$O/$f" | tail -12
  grep -q "== exit 0 after" "$O/$f" || rc=1
done
exit $rc
