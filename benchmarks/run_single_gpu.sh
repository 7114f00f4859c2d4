#!/usr/bin/env bash
# Every op on one GPU (world size 1, NCCL), 8 B to 1 GiB, pynccl and torch.distributed side by side
# in the same process: eager, CUDA graph (-G) and host-overhead (-C) runs. Text, JSON and plots go
# to OUTDIR (eager.txt, eager_<op>.json, eager_<op>.png, graph*, cputime*, versions.txt).
#   benchmarks/run_single_gpu.sh OUTDIR          (about 2-3 minutes on one H200)
# Exits non-zero if any result was wrong or a run failed; the other runs still go ahead.
set -uo pipefail
OUT=${1:?usage: benchmarks/run_single_gpu.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

# NOTE: at world size 1 even 1 GiB takes well under 1 ms per op, so 50 timed iterations and the
# median of 3 repetitions (pynccl and torch alternating) cost seconds, and steady the few-us times
# of small sizes. -f 2 walks every power of two from 8 B to 1 GiB (28 sizes), as nccl-tests runs do.
SWEEP=(all -b 8 -e 1G -f 2 -n 50 -w 5 --impl both --reps 3)

{
  date -u +"%Y-%m-%d %H:%M:%S UTC"; hostname
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
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

run eager
run graph -G 1
run cputime -C 1

echo
echo "== summary: time ratio pynccl/torch per op (geometric mean and worst size), and the 8 B rows"
for name in eager graph cputime; do
  echo "-- $name"
  awk '/Collective test starting/ {op=$NF} /^# ratio pynccl\/torch/ {print "  " op ": " substr($0, 3)}
       /^#          8 / {print "  " op "    8 B: " $0}' "$OUT/$name.txt"
done
exit $status
