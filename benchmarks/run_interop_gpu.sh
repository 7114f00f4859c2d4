#!/usr/bin/env bash
# The nccl side of torch.distributed interop (tests/test_interop.py, multigpu marker): torch groups
# mapped to pynccl communicators (members-only at 3+ GPUs), Work.get_future's stream semantics,
# object collectives, all_reduce_coalesced, monitored_barrier naming a missing rank in bounded time.
# Uses up to 4 visible GPUs. Log: OUTDIR/interop_gpu.log; exits non-zero on failure.
#   benchmarks/run_interop_gpu.sh OUTDIR
set -uo pipefail
OUTDIR=${1:?usage: run_interop_gpu.sh OUTDIR}
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m "gpu or multigpu" -v -rA -p no:cacheprovider tests/test_interop.py \
  >"$OUTDIR/interop_gpu.log" 2>&1
rc=$?
echo "== exit $rc" >>"$OUTDIR/interop_gpu.log"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|== exit" "$OUTDIR/interop_gpu.log" | tail -10
exit $rc
