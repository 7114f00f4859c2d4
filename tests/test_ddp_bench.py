"""benchmarks/ddp_bench.py's code paths on CPU (gloo, tiny model): the floor, torch DDP and pynccl
DDP alternate and are reported with their overhead; --levers gives one row per lever, timed in
its window, or the reason it was skipped (NCCL-only levers on gloo)."""
import json
import os
import subprocess
import sys

from repo_env import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ddp_bench_levers_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    env = subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "ddp_bench.py"), "--device", "cpu",
                           "--nproc", "2", "--model", "tiny", "--steps", "2", "--repeats", "2", "--warmup", "1",
                           "--levers", "bucket-10mb", "first-bucket-25mb", "cta-efficiency", "unpack-early", "tied-rows",
                           "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["model"] == "tiny" and r["num_params"] > 0
    # The baselines' samples from the three lever windows that ran (2 repeats x 2 steps each).
    assert set(r["modes"]) == {"no DDP", "torch DDP", "pynccl DDP"}
    assert all(m["n"] == 12 and m["median_ms"] > 0 for m in r["modes"].values()), r["modes"]
    rows = {row["mode"]: row for row in r["levers"]}
    assert list(rows) == ["pynccl DDP + bucket-10mb", "pynccl DDP + first-bucket-25mb", "pynccl DDP + cta-efficiency",
                          "pynccl DDP + unpack-early", "pynccl DDP + tied-rows"]
    for name in ("pynccl DDP + bucket-10mb", "pynccl DDP + first-bucket-25mb", "pynccl DDP + tied-rows"):
        assert all(rows[name][k] > 0 for k in ("step_ms", "floor_ms", "torch_ms", "default_ms")), rows[name]
    assert rows["pynccl DDP + cta-efficiency"]["skipped"] == "needs the nccl backend"
    assert rows["pynccl DDP + unpack-early"]["skipped"] == "needs the nccl backend"   # a CUDA-only path
    assert "over floor ms" in proc.stdout and "pynccl DDP overhead / torch DDP overhead" in proc.stdout
    assert "pynccl DDP + bucket-10mb" in proc.stdout


def test_ddp_bench_hidden_allreduce_bound_on_cpu(tmp_path):
    """The default modes include the bound 'no DDP + hidden all-reduce' (the gradients' bytes
    all-reduced from backward's start): timed like the others and reported against torch DDP."""
    out = tmp_path / "r.json"
    env = subprocess_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "ddp_bench.py"), "--device", "cpu",
                           "--nproc", "2", "--model", "tiny", "--steps", "2", "--repeats", "2", "--warmup", "1",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["modes"]) == ["no DDP", "no DDP + hidden all-reduce", "torch DDP", "pynccl DDP"]
    assert all(m["n"] == 4 and m["median_ms"] > 0 for m in r["modes"].values()), r["modes"]
    assert "'no DDP + hidden all-reduce' (the same bytes all-reduced from backward's start" in proc.stdout


def test_ddp_bench_refuses_modes_that_levers_would_drop():
    """--levers times only its windows against the three baselines: asking for the priority or
    Python-path modes as well is an error naming why, not a run that silently leaves them out."""
    env = subprocess_env(CUDA_VISIBLE_DEVICES="")
    for extra in ("--compare-priority", "--compare-py-path"):
        proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "ddp_bench.py"), "--device", "cpu",
                               "--model", "tiny", "--levers", "bucket-10mb", extra],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (extra, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "--compare-priority and --compare-py-path need a run without --levers" in proc.stderr, proc.stderr
