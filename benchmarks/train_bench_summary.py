"""One table from every train_bench JSON in a directory (what gpu_suite.py's train groups leave), and the
verdict: exit 1 if a row failed, or if a pair's losses after the last step (pynccl against torch in
one mode, a side compiled against the same side eager) differ by more than --loss-rtol (bf16 noise
after a few steps is well under 1 %; a pair that does not train alike is far over).

    python benchmarks/train_bench_summary.py OUTDIR
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench_lib import report  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--loss-rtol", type=float, default=0.02)
    args = p.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.outdir, "*.json")))
    if not paths:
        print(f"train_bench_summary: no JSON in {args.outdir}")
        return 1
    problems = []
    print(f"{'run':<22}" + report.HEADER)
    result = None
    everything, floors = [], []
    for path in paths:
        run = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            result = json.load(f)
        rows = result["rows"]
        for r in rows:
            r.setdefault("peak_gib", float("nan"))
            if r["peak_gib"] is None:
                r["peak_gib"] = float("nan")
            print(f"{run:<22}" + report.format_row(r))
            if r.get("error"):
                problems.append(f"{run}: {r['strategy']} {r['impl']} failed: {r['error']}")
        problems += report.loss_problems(rows, args.loss_rtol, prefix=f"{run}: ")
        floors += [f"# {run}: {line[2:]}" for line in report.floor_lines(rows)]     # --floor runs
        everything += [dict(r, run=run, model_shape=_shape(result)) for r in rows]
    print(f"# {result['world_size']} × {result['device']}, torch {result['torch']} (NCCL {result['torch_nccl']}), "
          f"pynccl NCCL runtime {result['nccl_runtime']}, transformers {result['transformers']} (last file's header)")
    for line in floors + report.tp_scaling(everything):
        print(line)
    for line in problems:
        print("PROBLEM:", line)
    return 1 if problems else 0


def _shape(result: dict) -> tuple:
    """What makes two files' rows the same training: the model and the batch per replica."""
    return tuple(result.get(k) for k in ("model", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                                         "seq", "batch", "dtype"))


if __name__ == "__main__":
    sys.exit(main())
