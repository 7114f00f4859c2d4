#!/usr/bin/env bash
# The multigpu tests at world size N (all visible GPUs, at most 4 per test) and at 2, run side by
# side: the N-GPU run on every GPU, the 2-GPU run on the last two (they share those two GPUs;
# no test here times anything). Logs: OUTDIR/multigpu<N>.log, OUTDIR/multigpu2.log.
#   benchmarks/run_multigpu_tests.sh OUTDIR
set -uo pipefail
OUTDIR=${1:?usage: run_multigpu_tests.sh OUTDIR}
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
PYTEST=(python3 -m pytest -m multigpu -v -rA -p no:cacheprovider tests)
t0=$SECONDS
(timeout "${TEST_TIMEOUT:-480}" "${PYTEST[@]}" >"$OUTDIR/multigpu$N.log" 2>&1; echo "== exit $? after $((SECONDS - t0)) s" >>"$OUTDIR/multigpu$N.log") &
if [ "$N" -gt 2 ]; then
  (CUDA_VISIBLE_DEVICES=$((N - 2)),$((N - 1)) timeout "${TEST_TIMEOUT:-480}" "${PYTEST[@]}" >"$OUTDIR/multigpu2.log" 2>&1
   echo "== exit $? after $((SECONDS - t0)) s" >>"$OUTDIR/multigpu2.log") &
fi
wait
for f in "$OUTDIR"/multigpu*.log; do echo "=== $f"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|== exit" "$f" | tail -20; done
