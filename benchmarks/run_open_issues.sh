#!/usr/bin/env bash
# The GPU measurements of the open issues in one device call on 4 GPUs (steps in priority order,
# each with min(its cap, what is left of BUDGET seconds); logs in OUTDIR, then a tarball):
#   #15  ZeRO-3 against FSDP2 on the ~1B Llama, the two sides alternating (--repeats)
#   #18  GPipe and 1F1B against torch.distributed.pipelining, with a per-rank timeline of one step
#   #19  DDP over the floor with the hidden-all-reduce bound (nanoGPT 124M, HF GPT-2 medium), 4 then 2 GPUs
#   the ZeRO GPU tests (zerotests), every GPU test (gputests: run_gpu_tests.sh), ZeRO-3 on GPT-2 medium (zero3gpt2),
#   ZeRO-1/2 against FSDP2 on the ~1B Llama (zero12), CUDA-graphed pipeline stages: their GPU tests
#   (ppgraphtests) and GPipe/1F1B with and without graphs against torch.distributed.pipelining (ppgraphs)
#   BUDGET=540 STEPS="zero3 pp ddp4 ddp2" benchmarks/run_open_issues.sh OUTDIR
set -uo pipefail
O=${1:?usage: run_open_issues.sh OUTDIR}
mkdir -p "$O"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BUDGET=${BUDGET:-540}
STEPS=${STEPS:-"zero3 pp ddp4 ddp2"}
PORT=29700
step() {  # step NAME CAP cmd...: cmd with min(CAP, time left) s; log $O/NAME.log; prints its tables
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 30 ]; then echo "=== $name: skipped (no time left)"; return; fi
  local t0=$SECONDS
  timeout -k 10 "$cap" "$@" >"$O/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s (cap $cap)"
  grep -E "^(# |strategy|zero|pp-|ddp|tp|mode|no DDP|torch DDP|pynccl DDP|FAILED|ERROR|[0-9]+ passed)|passed|failed" "$O/$name.log" | grep -v "^# \[" | head -60
}
tb() {  # tb NAME CAP train_bench args...
  local name=$1 cap=$2; shift 2; PORT=$((PORT + 1))
  step "$name" "$cap" torchrun --nproc_per_node 4 --master_port "$PORT" benchmarks/train_bench.py "$@" --json "$O/$name.json"
}
db() {  # db NAME CAP NPROC ddp_bench args...
  local name=$1 cap=$2 nproc=$3; shift 3; PORT=$((PORT + 1))
  step "$name" "$cap" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((nproc - 1)))" torchrun --nproc_per_node "$nproc" \
    --master_port "$PORT" benchmarks/ddp_bench.py --json "$O/$name.json" "$@"
}
python3 -c "import pynccl, torch, transformers; print('torch', torch.__version__, 'nccl', pynccl.nccl_version(), 'transformers', transformers.__version__)" >"$O/versions.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$O/versions.txt" 2>&1
cat "$O/versions.txt"
L1B="--model hf-llama --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048"
NOGRAPH=(--skip "no DDP + graph" "pynccl DDP + graph")
for s in $STEPS; do
  case $s in
    zero3) tb llama1b_zero3 150 $L1B --batch 4 --strategy zero3 --warmup 3 --steps 12 --repeats 3 ;;
    pp) tb llama1b_pp 200 $L1B --batch 8 --microbatches 8 --strategy pp-gpipe,pp-1f1b --warmup 3 --steps 10 --repeats 2 --timeline ;;
    ppgraphs) tb llama1b_ppgraphs 240 $L1B --batch 8 --microbatches 8 \
                --strategy pp-1f1b-graphs,pp-gpipe-graphs,pp-1f1b --warmup 3 --steps 10 --repeats 2 ;;
    ppgraphtests) step pp_graph_tests 150 python3 -m pytest -v -rA -p no:cacheprovider tests/test_pipeline_graphs_gpu.py ;;
    gputests) step gpu_tests 420 bash benchmarks/run_gpu_tests.sh "$O/gpu_tests" ;;
    zero12) tb llama1b_zero12 200 $L1B --batch 4 --strategy zero1,zero2 --warmup 3 --steps 12 --repeats 2 ;;
    zero3gpt2) tb gpt2m_zero3 100 --model hf-gpt2 --hidden 1024 --layers 24 --heads 16 --vocab 50257 --seq 1024 \
                 --batch 8 --strategy zero3 --warmup 3 --steps 12 --repeats 2 ;;
    zerotests) step zero_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_zero_gpu.py -m "gpu or multigpu" ;;
    ddp4) db nano_4gpu 100 4 --model nanogpt-124m --steps 6 --repeats 3 --warmup 3 --phases 6 --no-diagnostics "${NOGRAPH[@]}"
          db medium_4gpu 120 4 --model hf-gpt2-medium --steps 5 --repeats 3 --warmup 2 --phases 5 --no-diagnostics "${NOGRAPH[@]}" ;;
    ddp2) db nano_2gpu 80 2 --model nanogpt-124m --steps 6 --repeats 3 --warmup 3 --no-diagnostics "${NOGRAPH[@]}"
          db medium_2gpu 100 2 --model hf-gpt2-medium --steps 5 --repeats 3 --warmup 2 --no-diagnostics "${NOGRAPH[@]}" ;;
    *) echo "run_open_issues: unknown step $s" ;;
  esac
done
echo "=== total $SECONDS s"
