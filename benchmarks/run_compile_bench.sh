#!/usr/bin/env bash
# Issue 27 on a 2-GPU machine: pynccl against torch at its best, eager and compiled, with MFU.
# Every run is its own process (a crash or hang in one does not stop the others), in priority
# order, each with min(its cap, what is left of BUDGET seconds); logs + JSON in OUTDIR, then
# train_bench_summary's table and loss checks. Exit 1 if a run or row failed or losses disagree.
#   benchmarks/run_compile_bench.sh OUTDIR          (BUDGET=600 by default; NGPU=2)
#   ONLY="gpt2m llama1b" benchmarks/run_compile_bench.sh OUTDIR      (a subset, by name)
# Needs the built extension, transformers, and for the nanoGPT run its train.py, model.py and
# configurator.py in benchmarks/results/nanogpt/ (see benchmarks/nanogpt_swap.py; skipped if absent).
set -uo pipefail
O=${1:?usage: run_compile_bench.sh OUTDIR}
mkdir -p "$O/extra"                  # JSON that is not train_bench's (the summary reads $O/*.json)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BUDGET=${BUDGET:-600}
N=${NGPU:-2}
ONLY=${ONLY:-}
python3 -c "import pynccl, torch, transformers; print(pynccl.nccl_version(), 'torch', torch.__version__, \
'transformers', transformers.__version__)" >"$O/versions.txt" 2>&1 \
  || { cat "$O/versions.txt"; echo "run_compile_bench: needs pynccl built, transformers"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$O/versions.txt" 2>&1
cat "$O/versions.txt"

GPT2M="--model hf-gpt2 --hidden 1024 --layers 24 --heads 16 --vocab 50257 --seq 1024 --batch 8"
L1B="--model hf-llama --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 32000"
L1B="$L1B --seq 2048 --batch 4"
STEPS="--warmup 3 --steps 10"
FAILED=0
PORT=29711
wanted() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
capped() {  # capped NAME CAP: the seconds NAME may take (0: skip)
  local left=$((BUDGET - SECONDS)) cap=$2
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 30 ]; then echo "=== $1: skipped (no time left of BUDGET=$BUDGET s)" >&2; echo 0; else echo "$cap"; fi
}
bench() {  # bench NAME CAP NPROC train_bench args...: $O/NAME.log, $O/NAME.json
  local name=$1 nproc=$3 cap; shift 3
  wanted "$name" || return 0
  cap=$(capped "$name" "$2"); [ "$cap" = 0 ] && return 0
  PORT=$((PORT + 1))
  local t0=$SECONDS
  timeout -k 10 "$cap" torchrun --nproc_per_node "$nproc" --master_port "$PORT" benchmarks/train_bench.py \
    "$@" $STEPS --json "$O/$name.json" >"$O/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s (cap $cap)"
  sed -n '/^strategy /,/^$/p' "$O/$name.log" | head -40
  grep "^PROBLEM" "$O/$name.log"
  [ "$rc" = 0 ] || { FAILED=1; grep -E "Error" "$O/$name.log" | grep -v "^ " | tail -3; }
}

# 1. GPT-2 medium: DDP and ZeRO-1/2/3 against torch DDP, DDP + ZeroRedundancyOptimizer, FSDP2
#    unresharded and FSDP2 (torchtitan's wrapping), eager and compiled (~4 min, compilation bound).
bench gpt2m 300 "$N" $GPT2M --strategy ddp,zero1,zero2,zero3 --compile both
# 2. ~1B Llama: TP against DTensor TP (eager and compiled), TP+SP compiled against DTensor TP+SP with
#    async TP, ZeRO-3 against FSDP2 (torchtitan's wrapping), eager and compiled (~3.5 min).
bench llama1b 270 "$N" $L1B --strategy tp,tp-sp-async,zero3 --compile both
# 3. The one-GPU reference of the same per-rank batch: TP scaling (tp 2 step <= 0.6 x this) and the
#    no-communication floor of ZeRO-3 (~1.5 min).
bench llama1b_1gpu 120 1 $L1B --strategy tp --compile both
# 4. nanoGPT's own train.py (GPT-2 124M, compile=True), the wrapper swapped (~4 min: each variant
#    starts and compiles on its own; the most telling first, a line each as they finish).
if wanted nanogpt; then
  if [ -f benchmarks/results/nanogpt/train.py ]; then
    cap=$(capped nanogpt 300)
    if [ "$cap" != 0 ]; then
      t0=$SECONDS
      timeout -k 10 "$cap" python3 benchmarks/nanogpt_swap.py --nproc "$N" --json "$O/extra/nanogpt.json" \
        --variants torch-ddp,pynccl-ddp,zero3,zero1,zero2 --timeout 150 \
        --run-dir "$O/nanogpt_runs" >"$O/nanogpt.log" 2>&1
      rc=$?; echo "=== nanogpt rc=$rc $((SECONDS - t0))s (cap $cap)"; grep -v "^\[" "$O/nanogpt.log" | tail -16
      [ "$rc" = 0 ] || FAILED=1
    fi
  else
    echo "=== nanogpt: skipped (benchmarks/results/nanogpt/train.py missing; see nanogpt_swap.py)"
  fi
fi
# 5. Graph breaks on the nccl backend (a tiny Llama; aot_eager, ~40 s).
if wanted graph_breaks; then
  cap=$(capped graph_breaks 90)
  if [ "$cap" != 0 ]; then
    t0=$SECONDS
    timeout -k 10 "$cap" torchrun --nproc_per_node "$N" --master_port $((PORT + 50)) benchmarks/graph_breaks.py \
      --device cuda --models hf-llama --wrappers none,ddp,zero3,tp,torch-ddp,fsdp2 --modes whole,blocks \
      --json "$O/extra/graph_breaks.json" >"$O/graph_breaks.log" 2>&1
    rc=$?; echo "=== graph_breaks rc=$rc $((SECONDS - t0))s (cap $cap)"
    sed -n '/^model /,/^$/p' "$O/graph_breaks.log"
    [ "$rc" = 0 ] || FAILED=1
  fi
fi
echo "=== summary ($SECONDS s)"
python3 benchmarks/train_bench_summary.py "$O" | tee "$O/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || FAILED=1
exit $FAILED
