#!/usr/bin/env bash
# Every op across N GPUs of one host (one rank per GPU, NCCL), 8 B to 8 GiB, pynccl and
# torch.distributed side by side in the same processes: eager and CUDA graph (-G) runs, and host
# overhead (-C) to 64 MiB. Text, JSON and plots go to OUTDIR: eager.txt, eager_<op>.json,
# eager_<op>.png, graph*, cputime*, versions.txt. Exits non-zero if any result was wrong or a
# run failed (the other runs still go ahead).
#   benchmarks/run_multi_gpu.sh OUTDIR [NGPUS]      (NGPUS: all visible GPUs by default)
# Knobs (environment): BENCH_MAX (8G), BENCH_CPU_MAX (64M), BENCH_ITERS (20), BENCH_WARMUP (5),
# BENCH_REPS (1), BENCH_SKIP_CPUTIME (set: no -C run).
# Where a scheduler starts the ranks, use torchrun instead, e.g.
#   torchrun --nproc-per-node 8 -m pynccl.bench all -b 8 -e 8G -f 2 --impl both
set -uo pipefail
OUT=${1:?usage: benchmarks/run_multi_gpu.sh OUTDIR [NGPUS]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
N=${2:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
# NOTE: nccl-tests' reference figures (docs/benchmarks.md) are with NVLink SHARP off; keep ours comparable.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
mkdir -p "$OUT"

SWEEP=(all -b 8 -f 2 -n "${BENCH_ITERS:-20}" -w "${BENCH_WARMUP:-5}" --impl both --reps "${BENCH_REPS:-1}")
[ "$N" -gt 1 ] && SWEEP+=(--nproc "$N")   # one rank runs in this process

{
  date -u +"%Y-%m-%d %H:%M:%S UTC"; hostname; echo "ranks: $N"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  [ "$N" -gt 1 ] && nvidia-smi topo -m 2>&1 | head -20
  "$PY" -c 'import torch, pynccl; print("torch", torch.__version__, "cuda", torch.version.cuda, "torch NCCL", torch.cuda.nccl.version()); print("pynccl", pynccl.__version__, "NCCL", pynccl.nccl_version())' 2>&1
  env | grep '^NCCL_' || true
} > "$OUT/versions.txt"
cat "$OUT/versions.txt"

status=0
run() {  # run NAME [extra flags...]
  local name=$1; shift
  echo "== $name: $PY -m pynccl.bench ${SWEEP[*]} $*"
  local t0=$SECONDS
  "$PY" -m pynccl.bench "${SWEEP[@]}" "$@" -J "$OUT/${name}_{op}.json" --plot "$OUT/${name}_{op}.png" \
    2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=$rc
}

run eager -e "${BENCH_MAX:-8G}"
run graph -e "${BENCH_MAX:-8G}" -G 1
[ -n "${BENCH_SKIP_CPUTIME:-}" ] || run cputime -e "${BENCH_CPU_MAX:-64M}" -C 1

echo
echo "== summary per op: Avg bus bandwidth of each, time ratio pynccl/torch (geometric mean, worst), 8 B row"
for name in eager graph cputime; do
  echo "-- $name"
  awk '/Collective test starting/ {op=$NF}
       /^# Avg bus bandwidth/ {print "  " op ": pynccl Avg bus bandwidth " $NF}
       /^# torch: Avg bus bandwidth/ {print "  " op ": torch  Avg bus bandwidth " $NF}
       /^# ratio pynccl\/torch/ {print "  " op ": " substr($0, 3)}
       /^#          8 / {print "  " op ": 8 B  " substr($0, 2)}' "$OUT/$name.txt"
done
exit $status
