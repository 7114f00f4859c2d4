"""DDP step time in one run: the floor (the same per-GPU work with no wrapper and no communication),
torch DDP and pynccl DDP, alternating, with the overhead over the floor of each and the ratio
pynccl / torch (issue 19's target: <= 0.5); optionally pynccl DDP captured in a CUDA graph, the
levers of issue 19 (--levers), when each bucket's reduction starts within backward and what its
collective costs alone, and the pack kernel's bandwidth against a device-to-device copy.

    python benchmarks/ddp_bench.py                          # one GPU, world size 1
    python benchmarks/ddp_bench.py --nproc 4                # 4 GPUs, processes spawned here
    torchrun --nproc_per_node 4 benchmarks/ddp_bench.py --model hf-gpt2-medium
    torchrun --nproc_per_node 4 benchmarks/ddp_bench.py --levers          # floor / torch / pynccl / each lever
    python benchmarks/ddp_bench.py --device cpu --nproc 2 --model tiny    # the code paths on gloo
    python benchmarks/ddp_bench.py --grad-view both         # DDPs with gradient_as_bucket_view False and True

Models (ddp_bench_lib/models.py): nanogpt-124m (default: nanoGPT's train.py GPT-2 124M, batch 12 x 1024
per GPU), hf-gpt2-medium (transformers GPT2LMHeadModel, batch 8 x 1024), bench-gpt2-small (this
bench's model before issue 19), tiny / hf-tiny (CPU). Every mode uses nanoGPT's AdamW (fused, and
capturable on CUDA), bf16 autocast over fp32 parameters (--precision fp32 for plain fp32) and one
fixed synthetic batch, so step times differ only by the data-parallel wrapper. Every step sets
gradients to None first.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pynccl  # noqa: E402
from ddp_bench_lib import levers as lv  # noqa: E402
from ddp_bench_lib import profiling  # noqa: E402
from ddp_bench_lib.models import GPT, MODELS  # noqa: E402,F401  (GPT: zero_bench.py imports it from here)
from ddp_bench_lib.report import print_levers, print_report  # noqa: E402
from ddp_bench_lib.trainer import ALL_PRIO0, COMM_PRIO0, FLOOR, ORACLE, PY_PATH, VIEW, Trainer, step_times_ms  # noqa: E402

PRIO_MODES = [COMM_PRIO0, ALL_PRIO0]
MODES = [FLOOR, ORACLE, "torch DDP", "pynccl DDP", PY_PATH, COMM_PRIO0, ALL_PRIO0, FLOOR + " + graph", "pynccl DDP + graph"]
DDP_MODES = ["torch DDP", "pynccl DDP", PY_PATH, COMM_PRIO0, ALL_PRIO0, "pynccl DDP + graph"]  # per grad-view setting
LEVER_BASELINES = [FLOOR, "torch DDP", "pynccl DDP"]       # alive through every lever's window


def grad_view_settings(arg):
    # NOTE: "default": each DDP's own constructor default (torch False; pynccl's ddp/defaults.py: views),
    # issue 26's "default constructor arguments"; named False (no suffix) in the tables.
    return {"default": [None], "off": [False], "on": [True], "both": [False, True]}[arg]


def mode_names(settings, skip, compare_py_path=False, compare_priority=False):
    """Mode names in run order; a DDP mode gets VIEW appended when gradient_as_bucket_view=True
    (both DDPs, so torch DDP and pynccl DDP are always compared under the same setting)."""
    names = []
    for m in MODES:
        if m in skip or (m == PY_PATH and not compare_py_path) or (m in PRIO_MODES and not compare_priority):
            continue
        if m in DDP_MODES:
            names.extend(m + (VIEW if v else "") for v in settings)
        else:
            names.append(m)
    return names


def _progress(rank, msg):
    if rank == 0:
        print(f"# [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

def worker(rank, world_size, args):
    if args.stacks_after:
        import faulthandler
        faulthandler.dump_traceback_later(args.stacks_after, exit=True)   # a hang shows where it is
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not pynccl.is_initialized():
        pynccl.init_process_group(backend, device_id=local_rank if device.type == "cuda" else None)
    torch_pg = tdist.new_group(backend=backend)          # torch DDP's own communicator
    result = _measure(rank, world_size, args, device, torch_pg)
    if rank == 0 and args.torchrun:                     # torchrun: report before tearing down
        report(result, args)
    # NOTE: every trainer (and the CUDA graphs with captured collectives they hold) is gone with
    # _measure's frame: NCCL's finalize waits for graphs that still hold its operations.
    _free(device)
    pynccl.destroy_process_group()
    return result if rank == 0 else None


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_alternating(trainers, args, device, times, host):
    """args.repeats rounds of args.steps steps of each trainer in turn, so drift hits every mode alike."""
    for _ in range(args.repeats):
        for m, tr in trainers.items():
            times.setdefault(m, []).extend(step_times_ms(tr.step, args.steps, device, host.setdefault(m, [])))


def _warm_up(trainers, args, rank, device):
    for m, tr in trainers.items():
        _progress(rank, f"warm-up of '{m}'")
        for _ in range(args.warmup):
            tr.step()
        _sync(device)


def _summary(times, host):
    return {m: dict(median_ms=statistics.median(ts), min_ms=min(ts), max_ms=max(ts), n=len(ts),
                    host_ms=statistics.median(host[m])) for m, ts in times.items()}


def _measure(rank, world_size, args, device, torch_pg):
    spec = MODELS[args.model]
    args.batch, args.seq = args.batch or spec.batch, args.seq or spec.seq
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    batch = tuple(torch.randint(0, spec.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(2))
    settings = grad_view_settings(args.grad_view)
    if args.compare_priority:                           # a communicator whose stream has normal priority
        args.prio0_group = lv.make_group(lv.LEVERS["comm-prio0"])
    names = LEVER_BASELINES if args.levers is not None else \
        mode_names(settings, args.skip, args.compare_py_path, args.compare_priority)
    trainers = {}
    for m in names:
        _progress(rank, f"building '{m}'")
        trainers[m] = Trainer(m, args, device, torch_pg, batch)
    _warm_up(trainers, args, rank, device)
    _progress(rank, "timing")
    times, host = {}, {}
    lever_rows = _measure_levers(trainers, args, rank, device, torch_pg, batch, times, host) \
        if args.levers is not None else None
    if lever_rows is None:
        _time_alternating(trainers, args, device, times, host)
    cuda = device.type == "cuda"
    gaps = profiling.profile_steps(trainers, args.profile, rank) if args.profile and cuda else None
    phases = profiling.measure_phases(trainers, args) if args.phases and cuda else None
    nccl = str(pynccl.nccl_version()) if pynccl.get_backend() == "nccl" else "- (gloo)"
    device_name = torch.cuda.get_device_name(device) if cuda else "CPU (gloo)"
    result = dict(world_size=world_size, device=device_name, torch=torch.__version__, nccl=nccl,
                  model=args.model, model_description=spec.description, precision=args.precision,
                  batch=args.batch, seq=args.seq, grad_view=settings, modes=_summary(times, host), gpu_gaps=gaps,
                  phases=phases, levers=lever_rows, lever_steps=args.steps, lever_repeats=args.repeats)
    eager_name = next((m for m in trainers if m.startswith("pynccl DDP") and "graph" not in m), None)
    result["num_params"] = next(iter(trainers.values())).num_params
    ddp = next((tr.ddp for m, tr in trainers.items() if m.startswith("pynccl DDP") and tr.ddp is not None), None)
    if ddp is not None:
        path = ddp.reducer.comm_path
        result["comm_path"] = f"{path.name}" + (f" ({path.reason})" if path.reason else "")
    if eager_name is not None and cuda and not args.no_diagnostics:
        eager = trainers[eager_name]
        result["profiled_mode"] = eager_name
        _progress(rank, "bucket timeline and per-bucket all-reduce")
        ready, bwd_ms = eager.profile_buckets()
        result["backward_ms"] = bwd_ms
        result["buckets"] = profiling.bucket_table(eager.ddp, ready, args.steps)
        _progress(rank, "pack kernel vs copy")
        result["pack"], result["pack_per_bucket"] = profiling.pack_vs_copy(eager.ddp, args.steps)
    return result


def _out_of_time(args, t_start, device) -> bool:
    """Whether the time budget is spent, decided by rank 0 for all (the next lever's group is collective)."""
    flag = torch.tensor([float(args.budget_s > 0 and time.monotonic() - t_start > args.budget_s)], device=device)
    pynccl.broadcast(flag, 0)
    return bool(flag.item())


def _measure_levers(baselines, args, rank, device, torch_pg, batch, times, host):
    """Each lever's mode alternated with the floor, torch DDP and default pynccl DDP (kept alive
    throughout); one row per lever with the medians of its window. The baselines' samples from
    every window also make up the main table."""
    rows = []
    t_start = time.monotonic()
    for lever in lv.parse(args.levers):
        mode = lv.MODE_PREFIX + lever.name
        why = lv.unavailable(lever)
        if why is None and _out_of_time(args, t_start, device):
            why = f"the time budget (--budget-s {args.budget_s:g}) is spent"
        if why is not None:
            _progress(rank, f"skipping '{mode}': {why}")
            rows.append(dict(mode=mode, why=lever.why, skipped=why))
            continue
        _progress(rank, f"building '{mode}'")
        trainer = Trainer("pynccl DDP", args, device, torch_pg, batch, lever=lever, group=lv.make_group(lever))
        window = dict(baselines, **{mode: trainer})
        _warm_up({mode: trainer}, args, rank, device)
        w_times, w_host = {}, {}
        _time_alternating(window, args, device, w_times, w_host)
        med = {m: statistics.median(ts) for m, ts in w_times.items()}
        rows.append(dict(mode=mode, why=lever.why, step_ms=med[mode], floor_ms=med[FLOOR],
                         torch_ms=med["torch DDP"], default_ms=med["pynccl DDP"]))
        for m in baselines:
            times.setdefault(m, []).extend(w_times[m])
            host.setdefault(m, []).extend(w_host[m])
        del window, trainer
        _free(device)
    if not times:                                     # every lever skipped: the baselines alone
        _time_alternating(baselines, args, device, times, host)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="nanogpt-124m")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo, host-clock timing, eager modes only (checks the code paths)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (default: the model's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's context)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--grad-view", nargs="?", const="on", default="default", choices=["default", "off", "on", "both"],
                   help="gradient_as_bucket_view: 'default' (default) leaves it to each DDP's constructor (torch "
                        "False, pynccl True), --grad-view (= on) True for both, 'off' False for both, 'both' runs "
                        "the DDP modes under False and True in one process (floors shared)")
    p.add_argument("--skip", nargs="*", default=[], choices=MODES, help="modes to leave out")
    p.add_argument("--graph-modes", action="store_true",
                   help="run the CUDA-graph modes also for models whose graphs do not fit an 80 GB H100 beside the "
                        "other modes (hf-gpt2-medium)")
    p.add_argument("--levers", nargs="*", default=None, metavar="LEVER",
                   help=f"time the floor, torch DDP, pynccl DDP and pynccl DDP with each lever, alternating, a "
                        f"window per lever; 'default' (no names), 'all', or names from {sorted(lv.LEVERS)} "
                        f"(default set: {lv.DEFAULT_LEVERS})")
    p.add_argument("--budget-s", type=float, default=0, metavar="S",
                   help="--levers: start no new lever after S seconds of timing (0: no limit)")
    p.add_argument("--no-diagnostics", action="store_true", help="skip the bucket table and pack-vs-copy timings")
    p.add_argument("--compare-py-path", action="store_true",
                   help=f"also time '{PY_PATH}': pynccl DDP with each bucket's streams, pack, all-reduce and unpack "
                        "called from Python instead of one C++ call")
    p.add_argument("--phases", type=int, default=0, metavar="STEPS",
                   help="also time STEPS eager steps per mode phase by phase (GPU events and host clocks)")
    p.add_argument("--compare-priority", action="store_true",
                   help=f"also time '{COMM_PRIO0}' (a communicator made with PYNCCL_COMM_STREAM_HIGH_PRIORITY=0) and "
                        f"'{ALL_PRIO0}' (the pack stream at normal priority too)")
    p.add_argument("--nproc", type=int, default=1, help="processes to spawn (one GPU each) when not under torchrun")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--stacks-after", type=float, default=0, metavar="S",
                   help="dump every thread's stack and exit after S seconds (finding a hang)")
    p.add_argument("--profile", metavar="DIR", help="also profile 3 eager steps of each eager mode: GPU idle time "
                   "and its largest gaps are reported; chrome traces (rank 0) go to DIR")
    args = p.parse_args()
    if args.levers is not None and (args.compare_priority or args.compare_py_path):
        # NOTE: --levers times only its windows against the floor, torch DDP and pynccl DDP; these
        # modes would be dropped without a word (session 16 lost a priority A/B that way).
        p.error("--levers runs its lever windows against the floor, torch DDP and pynccl DDP only; "
                "--compare-priority and --compare-py-path need a run without --levers (or the lever comm-prio0)")
    args.prio0_group = None                             # set in the workers by --compare-priority
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("ddp_bench: no CUDA GPU here; --device cpu runs the code paths on gloo")
    graph_modes = {FLOOR + " + graph", "pynccl DDP + graph"}
    if args.device == "cpu":
        args.skip = sorted(set(args.skip) | graph_modes)   # no CUDA graphs
    elif not MODELS[args.model].graph_modes_fit and not args.graph_modes:
        print(f"ddp_bench: skipping the CUDA-graph modes for {args.model} (they do not fit an 80 GB H100 beside the "
              f"others; --graph-modes runs them)", file=sys.stderr)
        args.skip = sorted(set(args.skip) | graph_modes)
    # NOTE: decided here: run_multiprocess sets RANK in the processes it spawns as well.
    args.torchrun = "RANK" in os.environ
    if args.torchrun:                                   # rank 0 reports from its worker
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        from pynccl.testing import run_multiprocess
        report(run_multiprocess(worker, args.nproc, backend=None, start_method="spawn", timeout=1800,
                                args=(args,))[0], args)


def report(result, args):
    print_report(result)
    if result.get("levers"):
        print_levers(result)
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
