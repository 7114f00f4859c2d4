#!/usr/bin/env bash
# Tensor parallelism by plan on Hugging Face models, on GPUs (issue #18): tests/test_tp_plan_gpu.py
# (fp32 and bf16 plan checks at TP 2 and 4 against the unsharded model; examples/train_llama.py's
# dp × tp layouts with DDP / ZeRO on 4 GPUs against one CPU process). Needs transformers.
# Log: OUTDIR/tp_plan_gpu.log; exits with pytest's status (non-zero on any failure).
#   benchmarks/run_tp_plan_gpu.sh OUTDIR            # TEST_TIMEOUT=seconds (default 600)
set -uo pipefail
OUTDIR=${1:?usage: run_tp_plan_gpu.sh OUTDIR}
mkdir -p "$OUTDIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
t0=$SECONDS
timeout "${TEST_TIMEOUT:-600}" python3 -m pytest -m multigpu -v -rA -p no:cacheprovider tests/test_tp_plan_gpu.py \
  >"$OUTDIR/tp_plan_gpu.log" 2>&1
status=$?
echo "== exit $status after $((SECONDS - t0)) s" >>"$OUTDIR/tp_plan_gpu.log"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|== exit" "$OUTDIR/tp_plan_gpu.log" | tail -20
exit $status
