"""The GPU measurements and tests in one driver: named groups of commands, each run with a cap and
within one overall budget, its log kept and its table lines printed (RESULTS-ready).

    python benchmarks/gpu_suite.py --gpus 2 --budget 540 --out OUT contention ddp zero12
    python benchmarks/gpu_suite.py --list

Each command runs as its own process (torchrun for multi-GPU ones) with NCCL_NVLS_ENABLE=0, so a
crash or hang in one is contained: it is killed at its cap and the suite goes on. A group's
commands are skipped once less than 30 s of the budget is left. Everything fits an 80 GB H100.
"""
import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# ~1B Llama (HF config, random init): what the issues' ZeRO targets name.
L1B = "--model hf-llama --hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048"
GPT2M = "--model hf-gpt2 --hidden 1024 --layers 24 --heads 16 --vocab 50257 --seq 1024"
NOGRAPH = '--skip "no DDP + graph" "pynccl DDP + graph"'
SUMMARY = re.compile(r"^(# |strategy|zero|pp-|ddp|tp|mode|no DDP|torch DDP|pynccl DDP|\s*\d+(\.\d+)? |FAILED|ERROR|"
                     r"[=]+ .*(passed|failed))|passed|failed|Error")


def _torchrun(n, script, args):
    return f"torchrun --nproc_per_node {n} --master_port {{port}} {script} {args}"


def groups(n):
    """name -> [(step name, cap seconds, shell command)]; {port} and {out} are filled in per step."""
    tests = "python3 -m pytest -q -p no:cacheprovider -m 'gpu or multigpu'"
    return {
        "versions": [("versions", 60, "python3 -c \"import torch, pynccl, transformers; print('torch', torch.__version__, "
                                      "'pynccl NCCL', pynccl.nccl_version(), 'transformers', transformers.__version__)\"; "
                                      "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv")],
        "tests26": [("tests26", 240, f"{tests} tests/test_symmetric.py tests/test_reduce_op.py")],
        "contention": [("sm_contention", 150, _torchrun(n, "benchmarks/sm_contention.py", "--mib 25 100"))],
        "ddp": [("ddp_nano", 240, _torchrun(n, "benchmarks/ddp_bench.py", "--model nanogpt-124m --steps 8 --repeats 2 "
                                            "--warmup 3 --no-diagnostics --levers comm-default comm-symmetric "
                                            "comm-copy-engine max-ctas-4 grad-view --json {out}/ddp_nano.json")),
                ("ddp_medium", 240, _torchrun(n, "benchmarks/ddp_bench.py", f"--model hf-gpt2-medium --steps 5 "
                                              f"--repeats 2 --warmup 2 --no-diagnostics {NOGRAPH} --levers comm-default "
                                              f"comm-copy-engine --json {{out}}/ddp_medium.json"))],
        "zero12": [("zero12_sym", 200, _torchrun(n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero1,zero2 "
                                                 "--warmup 3 --steps 10 --repeats 2 --json {out}/zero12_sym.json")),
                   ("zero12_plain", 200, "PYNCCL_ZERO_SYMMETRIC=0 " + _torchrun(
                       n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero1,zero2 --warmup 3 --steps 10 "
                       "--repeats 2 --json {out}/zero12_plain.json"))],
        "zero3": [("zero3_llama", 200, _torchrun(n, "benchmarks/train_bench.py", f"{L1B} --batch 4 --strategy zero3 "
                                                 "--warmup 3 --steps 10 --repeats 2 --json {out}/zero3.json"))],
        "gputests": [("gpu_tests", 420, f"{tests} tests")],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="*", help="groups to run, in order")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--budget", type=float, default=540, help="seconds for everything")
    p.add_argument("--out", default="benchmarks/results/gpu_suite", help="logs and JSON go here")
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    table = groups(args.gpus)
    if args.list or not args.groups:
        for name, steps in table.items():
            print(f"{name}: " + "; ".join(f"{s} ({cap} s)" for s, cap, _ in steps))
        return
    unknown = [g for g in args.groups if g not in table]
    if unknown:
        sys.exit(f"gpu_suite: unknown group(s) {unknown}; --list shows them")
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0, port = time.monotonic(), 29600
    for g in args.groups:
        for name, cap, cmd in table[g]:
            left = args.budget - (time.monotonic() - t0)
            if left < 30:
                print(f"=== {name}: skipped (budget spent)", flush=True)
                continue
            port += 1
            cmd = cmd.format(port=port, out=shlex.quote(args.out))
            log = os.path.join(args.out, f"{name}.log")
            start = time.monotonic()
            with open(log, "w") as f:
                proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    rc = proc.wait(timeout=min(cap, left))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)     # torchrun and every rank it started
                    proc.wait()
                    rc = "timeout"
            print(f"=== {name} rc={rc} {time.monotonic() - start:.0f} s (cap {min(cap, left):.0f}): {cmd}", flush=True)
            with open(log) as f:
                lines = [ln.rstrip() for ln in f if SUMMARY.search(ln) and not ln.startswith("# [")]
            print("\n".join(lines[-60:]), flush=True)
    print(f"=== total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
