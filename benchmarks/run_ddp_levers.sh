#!/usr/bin/env bash
# Issue 19's GPU experiment in one device call: ddp_bench's floor / torch DDP / pynccl DDP
# (alternating, overhead over the floor and the ratio pynccl / torch) and the levers, each in its
# own window against the same three, for nanoGPT GPT-2 124M and HF GPT-2 medium at 4 then 2 GPUs.
#   BUDGET=360 benchmarks/run_ddp_levers.sh OUTDIR
# Steps run in priority order, each with min(its cap, what is left of BUDGET seconds); logs and
# JSON go to OUTDIR; exits non-zero if a step failed or ran out of time. Builds the extension first
# only if the importable one lacks this branch's bindings (Communicator.register_buffer).
set -uo pipefail
O=${1:?usage: run_ddp_levers.sh OUTDIR}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BUDGET=${BUDGET:-360}
PY=${PYTHON:-python3}
N=$($PY -c "import torch; print(min(4, torch.cuda.device_count()))")
FAILED=0
step() {  # step NAME CAP cmd...: runs cmd with min(CAP, time left) seconds, log in $O/NAME.log
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 30 ]; then echo "=== $name: skipped (no time left)"; FAILED=1; return; fi
  local t0=$SECONDS
  timeout -k 10 "$cap" "$@" >"$O/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s (cap $cap)"
  [ "$rc" -ne 0 ] && FAILED=1
  grep -v "^# \[" "$O/$name.log" | grep -E "^(#|mode|no DDP|torch DDP|pynccl DDP)" | grep -v "^# host ms" | head -40
}
bench() {  # bench NAME CAP NPROC ARGS...: ddp_bench under torchrun on the first NPROC GPUs
  local name=$1 cap=$2 nproc=$3; shift 3
  step "$name" "$cap" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((nproc - 1)))" \
    $PY -m torch.distributed.run --standalone --nproc_per_node "$nproc" benchmarks/ddp_bench.py \
    --json "$O/$name.json" "$@"
}
$PY -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" >"$O/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$O/versions.txt"
if ! $PY -c "import pynccl._ext as e; assert hasattr(e.require_extension('x').Communicator, 'register_buffer')" \
    >/dev/null 2>&1; then
  step build 150 $PY setup.py build_ext --inplace
fi
# --phases: GPU time of forward / backward / optimizer per mode (a longer backward with no idle GPU
# means NCCL takes SMs or bandwidth from it, rather than exposed transfer time).
# Levers per run: the 4-GPU nanoGPT run takes the default set (ddp_bench_lib/levers.py), the others
# the NCCL-side ones that most likely pay; --budget-s stops starting levers once it is spent.
bench nano_${N}gpu 95 "$N" --model nanogpt-124m --steps 6 --repeats 3 --warmup 3 --phases 10 --levers --budget-s 50
bench medium_${N}gpu 95 "$N" --model hf-gpt2-medium --steps 5 --repeats 3 --warmup 2 --phases 10 --no-diagnostics \
  --levers cta-efficiency max-ctas-8 register grad-view --budget-s 35
bench nano_2gpu 65 2 --model nanogpt-124m --steps 6 --repeats 3 --warmup 3 --no-diagnostics \
  --levers cta-efficiency max-ctas-8 register --budget-s 20
bench medium_2gpu 75 2 --model hf-gpt2-medium --steps 5 --repeats 3 --warmup 2 --no-diagnostics \
  --levers cta-efficiency register --budget-s 15
echo "=== total $SECONDS s; logs in $O"
exit $FAILED
