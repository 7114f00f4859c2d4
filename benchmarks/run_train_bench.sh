#!/usr/bin/env bash
# train_bench on a 4-GPU machine: every pynccl strategy against its torch counterpart on Hugging Face
# models (bf16), each run its own torchrun (a crash or hang in one does not stop the others), in
# priority order, each with min(its cap, what is left of BUDGET seconds). Logs + JSON in OUTDIR,
# then one summary table; exit 1 if any run or row failed or a pair's losses disagree (a run skipped
# for lack of time is reported, not failed).
#   benchmarks/run_train_bench.sh OUTDIR                 (BUDGET=480 by default; NGPU=4)
# Needs the built extension (python3 setup.py build_ext --inplace) and transformers.
set -uo pipefail
O=${1:?usage: run_train_bench.sh OUTDIR}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BUDGET=${BUDGET:-480}
N=${NGPU:-4}
python3 -c "import pynccl, transformers; print(pynccl.nccl_version(), 'transformers', transformers.__version__)" \
  >"$O/versions.txt" 2>&1 || { cat "$O/versions.txt"; echo "run_train_bench: needs pynccl built, transformers"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$O/versions.txt" 2>&1
cat "$O/versions.txt"

# GPT-2 medium (355M); a Llama of 1.1B (hidden 2048, 16 layers, GQA 32/8, ffn 8192); a Llama of 3.0B.
GPT2M="--model hf-gpt2 --hidden 1024 --layers 24 --heads 16 --vocab 50257 --seq 1024 --batch 8"
L1B="--model hf-llama --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048"
L3B="--model hf-llama --hidden 3072 --layers 28 --heads 24 --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048"
STEPS="--warmup 3 --steps 12"
FAILED=0
PORT=29611
bench() {  # bench NAME CAP NPROC train_bench args...: log $O/NAME.log, rows $O/NAME.json
  local name=$1 cap=$2 nproc=$3; shift 3
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 25 ]; then echo "=== $name: skipped (no time left of BUDGET=$BUDGET s)"; return; fi
  PORT=$((PORT + 1))
  local t0=$SECONDS
  timeout -k 10 "$cap" torchrun --nproc_per_node "$nproc" --master_port "$PORT" benchmarks/train_bench.py \
    "$@" $STEPS --json "$O/$name.json" >"$O/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s (cap $cap)"
  sed -n '/^strategy /,/^$/p' "$O/$name.log"
  [ "$rc" = 0 ] || { FAILED=1; grep -E "Error|error" "$O/$name.log" | grep -v "^ " | head -3; }
}
# issue #15 item 6: ZeRO-1/2/3 against FSDP2, both with fused AdamW.
bench gpt2m_zero3 60 "$N" $GPT2M --strategy zero3
bench llama1b_zero3 75 "$N" $L1B --batch 4 --strategy zero3
bench gpt2m_zero1 60 "$N" $GPT2M --strategy zero1
bench gpt2m_zero2 60 "$N" $GPT2M --strategy zero2
# issue #18 item 5: TP, PP, 2-D against torch's; DDP.
bench llama1b_tp 60 "$N" $L1B --batch 4 --strategy tp
bench llama1b_tp_sp 60 "$N" $L1B --batch 4 --strategy tp-sp
bench llama1b_pp_1f1b 60 "$N" $L1B --batch 8 --microbatches 8 --strategy pp-1f1b
bench llama1b_pp_gpipe 60 "$N" $L1B --batch 8 --microbatches 8 --strategy pp-gpipe
bench llama1b_pp_interleaved 60 "$N" $L1B --batch 8 --microbatches 8 --strategy pp-interleaved
bench llama1b_tp2xdp2 60 "$N" $L1B --batch 4 --strategy tp2xdp2
bench llama1b_ddp 60 "$N" $L1B --batch 4 --strategy ddp
# Optional, last: TP must pay at 3B (tp 4 faster than one GPU at the same batch).
bench llama3b_tp4 75 "$N" $L3B --batch 1 --strategy tp
bench llama3b_tp1 75 1 $L3B --batch 1 --strategy tp
echo "=== summary ($SECONDS s)"
python3 benchmarks/train_bench_summary.py "$O" | tee "$O/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || FAILED=1
exit $FAILED
