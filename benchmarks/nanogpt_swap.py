"""nanoGPT's own train.py with the data-parallel wrapper swapped: the same script, config and data
under torch DDP, pynccl DDP and pynccl ZeRO stages 1-3, one torchrun each; a table of the losses
(each variant against torch DDP's) and the time per iteration, tokens/s per GPU and MFU.

nanoGPT's train.py, model.py and configurator.py (karpathy/nanoGPT at 3adf61e, MIT) are vendored
unedited in benchmarks/nanogpt/ (its README.md). Another nanoGPT: `--nanogpt-git DIR` copies those
files from a git repository's HEAD (e.g. a mirror) into benchmarks/results/nanogpt/ (git-ignored)
and runs them, or `--nanogpt-dir DIR` runs a folder that has them. On 2 GPUs (compile=True,
nanoGPT's default):

    python benchmarks/nanogpt_swap.py --nproc 2
    python benchmarks/nanogpt_swap.py --device cpu --nproc 2 --tiny          # CPU, gloo, compile=False

What is swapped, in a copy of train.py (each edit must match exactly once, or the run stops):
  pynccl-ddp  `from torch.nn.parallel import DistributedDataParallel as DDP`
              -> `from pynccl import DistributedDataParallel as DDP`
  pynccl-ddp-tied-rows  the same import -> pynccl's DDP with tied_embedding_rows=True (the tied
              embedding's gradient tail as rows, pynccl/ddp/embedding_rows.py; it raises if it
              finds no tied embedding, so a run shows it was on)
  zeroK       the same import -> a DDP(model, device_ids) that returns
              pynccl.FullyShardedDataParallel(model, stage=K) (nanogpt_swap.zero_wrapper), and the
              clipping line -> pynccl.clip_grad_norm_ (torch's would clip each rank's shards by their
              local norm). Parameters stay fp32 under nanoGPT's own bf16 autocast, as with DDP.
  floor       train.py unchanged, one process without torchrun (no DDP, no communication),
              gradient_accumulation_steps=1: one GPU's share of a step (the same per-GPU batch); each
              variant's cost is its time over this, and its ratio that cost over torch DDP's (issue
              26). Its losses (one rank's data) are not compared
  --device cpu  train.py puts every torchrun process on cuda:LOCAL_RANK and passes device_ids to
              DDP: there it keeps --device and passes none.
Settings for a comparable run (override any with --set key=value): synthetic data (a learnable
token rule with random jumps, written as data/synthetic/{train,val}.bin), one micro-batch per rank
(gradient_accumulation_steps = nproc: nanoGPT's require_backward_grad_sync toggle is DDP's; ZeRO
would reduce every micro-batch), a constant learning rate, eval_iters=0 and no checkpoint: nanoGPT
evaluates on rank 0 alone, a forward that ZeRO (as FSDP) cannot run on one rank (it all-gathers).
The losses printed are rank 0's; the same seed gives every variant the same batches.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ["floor", "torch-ddp", "pynccl-ddp", "pynccl-ddp-tied-rows", "zero1", "zero2", "zero3"]
FILES = ("train.py", "model.py", "configurator.py")
VENDORED = os.path.join(HERE, "nanogpt")             # the files above, unedited (nanogpt/README.md)
FETCHED = os.path.join(HERE, "results", "nanogpt")   # where --nanogpt-git copies them (git-ignored)
IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP\n"
CLIP = "        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)\n"
CPU_PATCHES = [("    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
                "    if device.startswith('cuda'):\n        device = f'cuda:{ddp_local_rank}'\n"
                "        torch.cuda.set_device(device)\n"),
               ("    model = DDP(model, device_ids=[ddp_local_rank])\n",
                "    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)\n")]
GPU_SETTINGS = dict(batch_size=12, block_size=1024, n_layer=12, n_head=12, n_embd=768, max_iters=25)   # GPT-2 124M
# grad_clip 0.1: the tiny model's gradient norm is below nanoGPT's 1.0, and clipping must act; with
# lr 1e-2 over 12 iterations a ZeRO run that clipped each rank's shards by their own norm ends 1e-3
# off (the right one: bit-equal in fp32), past the 4 decimals train.py prints.
TINY_SETTINGS = dict(batch_size=4, block_size=32, n_layer=2, n_head=2, n_embd=32, max_iters=12, compile=False,
                     dtype="float32", backend="gloo", device="cpu", grad_clip=0.1, learning_rate=1e-2)
VOCAB, TINY_VOCAB = 50304, 64            # nanoGPT's GPT-2 vocabulary (50257 padded), a tiny one
# NOTE: train.py ends with torch's destroy_process_group() only; pynccl's group, bootstrapped from
# torch.distributed by the wrapper, is not destroyed. On gloo a rank has aborted as the interpreter
# exited, after the last iteration: 1 run in 16 in session 26 on CPU (torch 2.14), then none in the
# next 140 without an exit hook nor in 75 with a first one, so rare that no A/B could show what
# pynccl's exit hook (comm/groups.py's _gloo_workers_at_exit, the mechanism destroy_process_group's
# wait addressed) changes. torch DDP's own run, which never imports pynccl, aborted so in 1 run of 4 in
# session 31 (torch 2.14, another CPU VM): torch's gloo teardown. Such a run is reported as a problem of
# its own (exit_error), not as a failed run.
TEARDOWN_ABORT = "terminate called without an active exception"
ITER_RE = re.compile(r"^iter (\d+): loss ([-\d.naninf]+), time ([\d.]+)ms", re.M)


def zero_wrapper(stage: int):
    """What train.py's `DDP` becomes for ZeRO: DDP(model, device_ids=[...]) ->
    pynccl.FullyShardedDataParallel(model, stage=stage), pynccl set up on torch.distributed's
    world (which train.py initialised) the first time."""
    def wrap(module, device_ids=None):
        import torch
        import pynccl
        if not pynccl.is_initialized():
            if device_ids:
                pynccl.init_process_group("nccl", device_id=torch.device("cuda", device_ids[0]).index)
            else:
                pynccl.init_process_group("gloo")
        return pynccl.FullyShardedDataParallel(module, stage=stage)
    return wrap


def tied_rows_ddp(module, device_ids=None):
    """What train.py's `DDP` becomes for pynccl-ddp-tied-rows."""
    import pynccl
    return pynccl.DistributedDataParallel(module, device_ids=device_ids, tied_embedding_rows=True)


def patched_train_py(source: str, variant: str, device: str) -> str:
    """train.py's text with the variant's swap (see the module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"nanogpt_swap: unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")

    def swap(text, old, new):
        if text.count(old) != 1:
            raise ValueError(f"nanogpt_swap: expected one {old.strip()!r} in train.py, found {text.count(old)}")
        return text.replace(old, new)
    if variant == "floor":
        pass
    elif variant == "pynccl-ddp":
        source = swap(source, IMPORT, "from pynccl import DistributedDataParallel as DDP\n")
    elif variant == "pynccl-ddp-tied-rows":
        source = swap(source, IMPORT, "from nanogpt_swap import tied_rows_ddp as DDP\n")
    elif variant.startswith("zero"):
        stage = int(variant[-1])
        source = swap(source, IMPORT, f"from nanogpt_swap import zero_wrapper\nDDP = zero_wrapper({stage})\n")
        source = swap(source, CLIP, CLIP.replace("torch.nn.utils.clip_grad_norm_",
                                                 "__import__('pynccl').clip_grad_norm_"))
    if device == "cpu":
        for old, new in CPU_PATCHES:
            source = swap(source, old, new)
    return source


def write_data(folder: str, tokens: int, vocab: int, seed: int = 0) -> None:
    """train.bin / val.bin (uint16, nanoGPT's format): x[t+1] = (5·x[t] + 3) mod vocab, restarting
    at a random token with probability 1/16, so the loss falls fast and keeps falling; meta.pkl
    holds the vocabulary size (train.py reads it)."""
    import pickle
    import numpy as np
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for name, n in (("train.bin", tokens), ("val.bin", max(tokens // 10, 4096))):
        x = np.empty(n, dtype=np.int64)
        x[0] = rng.integers(vocab)
        jumps = rng.random(n) < 1 / 16
        fresh = rng.integers(vocab, size=n)
        for t in range(1, n):
            x[t] = fresh[t] if jumps[t] else (5 * x[t - 1] + 3) % vocab
        x.astype(np.uint16).tofile(os.path.join(folder, name))
    with open(os.path.join(folder, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": vocab}, f)


def fetch_from_git(git_dir: str, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    for f in FILES:
        text = subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{f}"], check=True, capture_output=True,
                              text=True).stdout
        with open(os.path.join(dest, f), "w") as out:
            out.write(text)


def settings_for(args) -> dict:
    s = dict(TINY_SETTINGS if args.tiny else GPU_SETTINGS)
    s.setdefault("device", args.device)
    s.update(dataset="synthetic", gradient_accumulation_steps=args.nproc, eval_iters=0, eval_interval=1_000_000,
             always_save_checkpoint=False, log_interval=1, decay_lr=False, out_dir="out")
    s.setdefault("learning_rate", 1e-3)
    for kv in args.set:
        key, _, value = kv.partition("=")
        s[key] = value
    if args.device == "cpu":
        s.update(device="cpu", backend="gloo")
    return s


def vocab_for(args) -> int:
    return TINY_VOCAB if args.tiny else VOCAB


def run_variant(variant: str, args, settings: dict, run_root: str) -> dict:
    """One torchrun of the patched train.py in its own folder; rank 0's iterations parsed."""
    folder = os.path.join(run_root, variant)
    os.makedirs(folder, exist_ok=True)
    for f in ("model.py", "configurator.py"):
        shutil.copy(os.path.join(args.nanogpt_dir, f), folder)
    with open(os.path.join(args.nanogpt_dir, "train.py")) as f:
        source = f.read()
    with open(os.path.join(folder, "train.py"), "w") as f:
        f.write(patched_train_py(source, variant, args.device))
    shutil.copytree(os.path.join(run_root, "data"), os.path.join(folder, "data", "synthetic"), dirs_exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if variant == "floor":           # one process, no torchrun: train.py runs without DDP
        cmd = [sys.executable, "train.py"] + [f"--{k}={v}" for k, v in dict(settings, gradient_accumulation_steps=1).items()]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "train.py"] + [f"--{k}={v}" for k, v in settings.items()]
    try:
        proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        proc = subprocess.CompletedProcess(cmd, 124, out, f"nanogpt_swap: timed out after {args.timeout:g} s")
    log = proc.stdout + proc.stderr
    with open(os.path.join(folder, "log.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n" + log)
    iters = [(int(i), float(loss), float(ms)) for i, loss, ms in ITER_RE.findall(proc.stdout)]
    row = dict(variant=variant, rc=proc.returncode, losses=[loss for _, loss, _ in iters],
               ms=[ms for _, _, ms in iters], log=os.path.join(folder, "log.txt"))
    complete = bool(iters) and iters[-1][0] == int(settings["max_iters"])
    if proc.returncode != 0 and complete and TEARDOWN_ABORT in log:
        # Trained to the end, then a rank aborted while the interpreter exited: the numbers stand,
        # the crash is reported on its own (see TEARDOWN_ABORT).
        row["exit_error"] = f"rc={proc.returncode} after the last iteration: {TEARDOWN_ABORT!r}"
    elif proc.returncode != 0 or not iters:
        errors = [ln.strip() for ln in log.splitlines() if re.search(r"\w(Error|Exception): ", ln)]
        row["error"] = f"rc={proc.returncode}, {len(iters)} iterations; " + (errors[-1] if errors else "")[:400]
    return row


def summarise(rows, settings: dict, args) -> list:
    """Median ms per iteration after --skip iterations (compilation), tokens/s per GPU, MFU,
    and each variant's largest relative loss difference from torch DDP's, step by step."""
    from train_bench_lib import mfu
    tokens_iter = (int(settings["batch_size"]) * int(settings["block_size"])
                   * int(settings["gradient_accumulation_steps"]))
    flops = nanogpt_flops_per_token(dict(settings, vocab=vocab_for(args)))
    peak = _peak(args.device) if settings.get("dtype", "bfloat16") == "bfloat16" else None
    ref = next((r for r in rows if r["variant"] == "torch-ddp" and not r.get("error")), None)
    floor = next((r for r in rows if r["variant"] == "floor" and not r.get("error")), None)
    problems = []
    for r in rows:
        if r.get("error"):
            problems.append(f"{r['variant']}: failed ({r['error']})")
            continue
        if r.get("exit_error"):
            problems.append(f"{r['variant']}: the processes did not exit cleanly ({r['exit_error']})")
        timed = r.get("timed") or r["ms"][args.skip:] or r["ms"]
        r["median_ms"] = statistics.median(timed)
        # NOTE: the floor is one GPU running gradient_accumulation_steps=1: one micro-batch per iteration.
        gpu_share = int(settings["gradient_accumulation_steps"]) if r is floor else args.nproc
        r["tokens_per_s_gpu"] = tokens_iter / gpu_share / (r["median_ms"] / 1e3)
        r["mfu"] = mfu.mfu(flops, r["tokens_per_s_gpu"], peak)
        if r is floor:
            continue
        if ref is not None and r is not ref:
            n = min(len(r["losses"]), len(ref["losses"]))
            r["max_loss_rdiff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
            r["ms_vs_torch"] = r["median_ms"] / ref["median_ms"]
            if r["max_loss_rdiff"] > args.loss_rtol or n < len(ref["losses"]):
                problems.append(f"{r['variant']}: losses {r['losses']} vs torch DDP's {ref['losses']} (largest "
                                f"relative "
                                f"difference {r['max_loss_rdiff']:.2e} > {args.loss_rtol:g}, or fewer iterations)")
    if floor is not None and "median_ms" in floor:
        for r in rows:
            if r is not floor and "median_ms" in r:
                r["over_floor_ms"] = r["median_ms"] - floor["median_ms"]
        if ref is not None and "over_floor_ms" in ref:
            for r in rows:
                if r is not ref and "over_floor_ms" in r and ref["over_floor_ms"] > 0:
                    r["overhead_vs_torch"] = r["over_floor_ms"] / ref["over_floor_ms"]
    return problems


def nanogpt_flops_per_token(settings: dict) -> int:
    """train_bench_lib.mfu's formula (torchtitan's) for the run's nanoGPT GPT, built on the meta
    device from nanoGPT's model.py (the vendored one, benchmarks/nanogpt/)."""
    import torch
    from nanogpt import model as nanogpt_model
    from train_bench_lib import mfu
    cfg = nanogpt_model.GPTConfig(block_size=int(settings["block_size"]), vocab_size=int(settings["vocab"]),
                                  n_layer=int(settings["n_layer"]), n_head=int(settings["n_head"]),
                                  n_embd=int(settings["n_embd"]), bias=str(settings.get("bias", False)) == "True")
    with torch.device("meta"):
        model = nanogpt_model.GPT(cfg)
    return mfu.flops_per_token(model, cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size)


def _peak(device: str):
    if device != "cuda":
        return None
    import torch
    from train_bench_lib import mfu
    return mfu.peak_bf16_flops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def print_table(rows, settings: dict) -> None:
    print(f"# nanoGPT train.py, wrapper swapped: n_layer {settings['n_layer']}, n_embd {settings['n_embd']}, "
          f"batch {settings['batch_size']} x {settings['block_size']} per rank, "
          f"compile={settings.get('compile', True)}, "
          f"dtype {settings.get('dtype', 'bfloat16')}")
    print(f"{'variant':<22}{'iters':>6}{'median ms':>11}{'vs torch':>10}{'over floor':>12}{'cost/torch':>12}"
          f"{'tok/s/GPU':>11}{'MFU':>7}{'first loss':>12}{'last loss':>11}{'max rel diff':>14}")
    for r in rows:
        if r.get("error"):
            print(f"{r['variant']:<22}FAILED: {r['error']}")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        vs = f"{r['ms_vs_torch']:.3f}" if "ms_vs_torch" in r else "-"
        rd = f"{r['max_loss_rdiff']:.2e}" if "max_loss_rdiff" in r else "-"
        over = f"{r['over_floor_ms']:.2f}" if "over_floor_ms" in r else "-"
        cost = f"{r['overhead_vs_torch']:.2f}" if "overhead_vs_torch" in r else "-"
        print(f"{r['variant']:<22}{len(r['losses']):>6}{r['median_ms']:>11.2f}{vs:>10}{over:>12}{cost:>12}"
              f"{r['tokens_per_s_gpu']:>11,.0f}"
              f"{mfu:>7}{r['losses'][0]:>12.4f}{r['losses'][-1]:>11.4f}{rd:>14}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nanogpt-dir", help="folder with nanoGPT's train.py, model.py, configurator.py (default: "
                                         "the vendored benchmarks/nanogpt/, or with --nanogpt-git where it copies them: "
                                         "benchmarks/results/nanogpt/)")
    p.add_argument("--nanogpt-git", help="copy those files from this git repository's HEAD first")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model for CPU (compile=False, fp32, gloo)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a train.py setting")
    p.add_argument("--skip", type=int, default=5, help="iterations left out of the timing (compilation)")
    p.add_argument("--loss-rtol", type=float, default=0.02)
    p.add_argument("--timeout", type=float, default=900, help="seconds per variant")
    p.add_argument("--run-dir", default=os.path.join(HERE, "results", "nanogpt_runs"))
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variants in turn this many times; each variant's median is over the timed "
                        "iterations of all its rounds (the losses are its first round's)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.nanogpt_dir is None:
        args.nanogpt_dir = FETCHED if args.nanogpt_git else VENDORED
    elif args.nanogpt_git and os.path.abspath(args.nanogpt_dir) == VENDORED:
        p.error("--nanogpt-git would overwrite the vendored benchmarks/nanogpt/; give another --nanogpt-dir")
    if args.nanogpt_git:
        fetch_from_git(args.nanogpt_git, args.nanogpt_dir)
    missing = [f for f in FILES if not os.path.exists(os.path.join(args.nanogpt_dir, f))]
    if missing:
        print(f"nanogpt_swap: {', '.join(missing)} missing in {args.nanogpt_dir}")
        return 2
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    settings = settings_for(args)
    tokens = 50 * int(settings["block_size"]) * int(settings["batch_size"]) * args.nproc
    write_data(os.path.join(args.run_dir, "data"), max(tokens, 100_000), vocab_for(args))
    rows = {}
    for round_ in range(args.rounds):
        for v in variants:             # one line each as they finish: a run cut short keeps the others'
            r = run_variant(v, args, settings, args.run_dir)
            print(f"# round {round_ + 1}, {v}: rc {r['rc']}, {len(r['losses'])} iterations, losses "
                  f"{r['losses'][:1]}..{r['losses'][-1:]}, ms {r['ms'][-3:]}{'; ' + r['error'] if r.get('error') else ''}",
                  flush=True)
            first = rows.setdefault(v, r)
            if r.get("error"):
                first.setdefault("error", r["error"])
            first.setdefault("timed", []).extend(r["ms"][args.skip:])
            first.setdefault("rounds_median_ms", []).append(
                round(statistics.median(r["ms"][args.skip:]), 2) if r["ms"][args.skip:] else None)
    rows = list(rows.values())
    problems = summarise(rows, settings, args)
    print_table(rows, settings)
    for line in problems:
        print("PROBLEM:", line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=settings, rows=rows), f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
