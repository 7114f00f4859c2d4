"""DDP step time on a GPT-2-small-sized model (124M parameters), in one run: no DDP, torch DDP,
pynccl DDP eager, and no DDP / pynccl DDP with the whole step captured in a CUDA graph; when each bucket's
reduction starts within backward and what its collective costs alone (CUDA events); and the
pack kernel's bandwidth against a device-to-device copy of the same bytes.

    python benchmarks/ddp_bench.py                          # one GPU, world size 1
    python benchmarks/ddp_bench.py --nproc 4                # 4 GPUs, processes spawned here
    torchrun --nproc_per_node 8 benchmarks/ddp_bench.py     # or under torchrun
    python benchmarks/ddp_bench.py --grad-view both         # DDPs with gradient_as_bucket_view False and True

Every step sets gradients to None first (both DDPs then copy each fresh gradient into its bucket
once; with gradient_as_bucket_view=True nothing is copied back).

Precision: bf16 autocast over fp32 parameters, gradients, buckets and AdamW (--precision fp32
for plain fp32). Every mode uses the same AdamW(fused=True, capturable=True) and one fixed
synthetic batch, so step times differ only by the data-parallel wrapper.
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pynccl  # noqa: E402


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)                      # 3 x (b, t, d)
        q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # (b, h, t, d/h)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 small: 12 layers, 12 heads, d=768, vocab 50304 (padded), context 1024, tied head."""

    def __init__(self, vocab=50304, ctx=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)                                    # (b, t, d)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))                                       # (b, t, vocab)


# ----------------------------------------------------------------------------- timing
def _events_ms(fn, iters, host=None):
    """ms of fn() for each of `iters` back-to-back runs, timed with CUDA events. If `host` is a
    list, the host time each call took to return (launch time; no sync) is appended to it."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        t0 = time.perf_counter()
        fn()
        if host is not None:
            host.append(1e3 * (time.perf_counter() - t0))
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return times


class Trainer:
    """One mode: model + optimizer + a step function (eager, or a CUDA graph replay)."""

    def __init__(self, mode, args, device, torch_pg, batch):
        torch.manual_seed(0)
        grad_view = mode.endswith(VIEW)
        model = GPT().to(device)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.ddp = None
        if mode.startswith("torch DDP"):
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index], process_group=torch_pg,
                                                        gradient_as_bucket_view=grad_view)
        elif mode.startswith("pynccl"):
            prio0 = mode.startswith(COMM_PRIO0) or mode.startswith(ALL_PRIO0)
            model = self.ddp = pynccl.DistributedDataParallel(model, device_ids=[device.index],
                                                              gradient_as_bucket_view=grad_view,
                                                              process_group=args.prio0_group if prio0 else None)
            if mode.startswith(ALL_PRIO0):
                self.ddp.reducer.pack_stream = torch.cuda.Stream(device)
            # The default hook, as a user has it: a bucket is one C++ call, except in the
            # PY_PATH mode, which runs the same streams and kernels through Python.
            self.ddp.reducer.allow_fused = PY_PATH not in mode
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True, capturable=True)
        self.x, self.y = batch
        self.autocast = args.precision == "bf16"
        self.graph = None
        if "+ graph" in mode:
            self._capture()

    def forward_loss(self):
        with torch.autocast("cuda", torch.bfloat16, enabled=self.autocast, cache_enabled=False):
            logits = self.model(self.x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), self.y.view(-1))

    def eager_step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        loss.backward()
        self.opt.step()
        return loss

    def phase_step(self):
        """One eager step with CUDA events and host clocks between its phases: (GPU ms, host ms)
        per phase (forward incl. zero_grad and loss, backward incl. DDP's end-of-backward work, optimizer)."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        host = [0.0] * 4
        ev[0].record()
        host[0] = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        ev[1].record()
        host[1] = time.perf_counter()
        loss.backward()
        ev[2].record()
        host[2] = time.perf_counter()
        self.opt.step()
        ev[3].record()
        host[3] = time.perf_counter()
        return ev, host

    def _capture(self):
        # Eager warm-up on a side stream builds, then rebuilds, the buckets (see pynccl/ddp/module.py).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.eager_step()
        torch.cuda.current_stream().wait_stream(side)
        self.opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            loss = self.forward_loss()
            loss.backward()
            self.opt.step()

    def step(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.eager_step()

    def profile_buckets(self):
        """One eager step: GPU time from backward's start at which each bucket became ready (its
        last gradient made, on the compute stream), and backward's length (the end includes
        waiting for and unpacking the buckets)."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events = []
        bucketer = self.ddp.reducer.bucketer
        on_ready = bucketer.on_bucket_ready

        def timed_on_ready(b):                      # benchmark-only: an event where the bucket is handed on
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.append((b.index, ev))
            on_ready(b)

        bucketer.on_bucket_ready = timed_on_ready
        try:
            start.record()
            loss.backward()
            end.record()
            torch.cuda.synchronize()
        finally:
            bucketer.on_bucket_ready = on_ready
        ready = {i: start.elapsed_time(ev) for i, ev in events}
        self.opt.zero_grad(set_to_none=True)
        return ready, start.elapsed_time(end)


def bucket_table(ddp, ready_ms, iters):
    """Each bucket's all-reduce alone (CUDA events around it, median of `iters`)."""
    rows = []
    ws = pynccl.get_world_size()
    for b in ddp.reducer.bucketer.buckets:
        wire = b.extra["wire"]
        times = _events_ms(lambda: pynccl.all_reduce(wire), iters)
        t = statistics.median(times)
        nbytes = wire.numel() * wire.element_size()
        algbw = nbytes / (t * 1e-3) / 1e9
        rows.append(dict(bucket=b.index, num_params=len(b.params), mbytes=nbytes / 2**20, ready_ms=ready_ms.get(b.index),
                         allreduce_us=t * 1e3, busbw_gbs=algbw * 2 * (ws - 1) / ws, algbw_gbs=algbw))
    return rows


def _timed(fn, iters):
    for _ in range(3):
        fn()
    return statistics.median(_events_ms(fn, iters))


def pack_vs_copy(ddp, iters):
    """The pack kernel against device-to-device copies of the same bytes; GB/s counts bytes read +
    written, as for a copy. Two comparisons: every bucket at once (one pack launch per bucket
    against ONE copy of all the bytes: launch count differs) and bucket by bucket (one pack
    launch against one copy of that bucket's bytes: same launch count), summed over buckets."""
    backend = pynccl.get_default_group().backend
    ws = pynccl.get_world_size()
    buckets = ddp.reducer.bucketer.buckets
    grads = [[torch.randn_like(p) for p in b.params] for b in buckets]
    sizes = [b.buffer.numel() * b.buffer.element_size() for b in buckets]
    nbytes = sum(sizes)
    src = torch.randn(nbytes // 4, device=buckets[0].buffer.device)
    dst = torch.empty_like(src)
    biggest = max(range(len(buckets)), key=lambda i: buckets[i].numel)
    cases = {   # name: (fn, bytes it packs or copies)
        "pack (scale 1/world_size), all buckets, 1 launch/bucket":
            (lambda: [backend.pack(g, b.buffer, 1.0 / ws) for g, b in zip(grads, buckets)], nbytes),
        "pack (scale 0.5), all buckets, 1 launch/bucket":
            (lambda: [backend.pack(g, b.buffer, 0.5) for g, b in zip(grads, buckets)], nbytes),
        "unpack, all buckets, 1 launch/bucket": (lambda: [backend.unpack(b.buffer, g, 1.0) for g, b in zip(grads, buckets)], nbytes),
        f"pack, bucket {biggest} ({len(buckets[biggest].params)} tensors)":
            (lambda: backend.pack(grads[biggest], buckets[biggest].buffer, 1.0 / ws), sizes[biggest]),
        "device-to-device copy, all bytes, 1 launch": (lambda: dst.copy_(src), nbytes),
    }
    out = {}
    for name, (fn, moved) in cases.items():
        t = _timed(fn, iters)
        out[name] = dict(ms=t, gbs=2 * moved / (t * 1e-3) / 1e9)
    per_bucket = []
    for i, b in enumerate(buckets):
        n = sizes[i] // 4
        pack_ms = _timed(lambda: backend.pack(grads[i], b.buffer, 1.0 / ws), iters)
        unpack_ms = _timed(lambda: backend.unpack(b.buffer, grads[i], 1.0), iters)
        copy_ms = _timed(lambda: dst[:n].copy_(src[:n]), iters)
        per_bucket.append(dict(bucket=b.index, num_tensors=len(b.params), mbytes=sizes[i] / 2**20, pack_ms=pack_ms,
                               unpack_ms=unpack_ms, copy_ms=copy_ms))
    return out, per_bucket


def _kernel_timeline(trace_path):
    """(kernels, memcpy/memset) of a chrome trace as (start_us, end_us, stream, name), by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("stream"), e["name"]))
    out.sort()
    return out


def _gap_summary(kernels, steps):
    """GPU time of the profiled steps: span, time the GPU ran no kernel at all, and the largest
    such gaps (what ran after each), all per step."""
    if not kernels:
        return {}
    span = kernels[-1][1] - kernels[0][0]
    idle, gaps, end = 0.0, [], kernels[0][1]
    for start, stop, stream, name in kernels[1:]:
        if start > end:
            idle += start - end
            gaps.append((start - end, name[:60]))
        end = max(end, stop)
    gaps.sort(reverse=True)
    streams = {}
    for start, stop, stream, _ in kernels:
        streams[stream] = streams.get(stream, 0.0) + (stop - start)
    return dict(span_ms=span / 1e3 / steps, gpu_idle_ms=idle / 1e3 / steps,
                busy_ms_per_stream={str(k): v / 1e3 / steps for k, v in streams.items()},
                top_gaps_us=[(round(g, 1), n) for g, n in gaps[:8]])


PHASES = ("forward", "backward", "optimizer")


def measure_phases(trainers, args):
    """Median GPU and host ms per phase of the eager modes' steps (args.phases steps each,
    interleaved in 5 rounds): where an eager overhead sits."""
    out = {m: {f"{k} {ph}": [] for k in ("gpu", "host") for ph in PHASES} for m in trainers if "graph" not in m}
    for _ in range(5):
        for m in out:
            recs = [trainers[m].phase_step() for _ in range(max(1, args.phases // 5))]
            torch.cuda.synchronize()
            for ev, host in recs:
                for i, ph in enumerate(PHASES):
                    out[m][f"gpu {ph}"].append(ev[i].elapsed_time(ev[i + 1]))
                    out[m][f"host {ph}"].append(1e3 * (host[i + 1] - host[i]))
    return {m: {k: statistics.median(v) for k, v in d.items()} for m, d in out.items()}


def profile_steps(trainers, outdir, rank, steps=3):
    """torch.profiler over `steps` eager steps of each eager mode: where the GPU sat idle. Writes
    <outdir>/trace_<mode>.json.gz (rank 0) and returns {mode: summary}."""
    import gzip
    import shutil
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(outdir, exist_ok=True)
    out = {}
    for m, tr in trainers.items():
        if "graph" in m:
            continue
        tr.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                tr.step()
            torch.cuda.synchronize()
        slug = m.replace(" ", "_").replace("[", "").replace("]", "")
        path = os.path.join(outdir, f"trace_{slug}_rank{rank}.json")
        prof.export_chrome_trace(path)
        out[m] = _gap_summary(_kernel_timeline(path), steps)
        if rank == 0:
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
        os.remove(path)
    return out


# ----------------------------------------------------------------------------- driver
PY_PATH = "pynccl DDP py-path"                   # eager, buckets through Python (reducer.allow_fused = False)
COMM_PRIO0 = "pynccl DDP comm-prio0"             # eager, the communicator's stream at normal priority
ALL_PRIO0 = "pynccl DDP all-prio0"               # ... and the pack stream too
PRIO_MODES = [COMM_PRIO0, ALL_PRIO0]
MODES = ["no DDP", "torch DDP", "pynccl DDP", PY_PATH, COMM_PRIO0, ALL_PRIO0, "no DDP + graph", "pynccl DDP + graph"]
DDP_MODES = ["torch DDP", "pynccl DDP", PY_PATH, COMM_PRIO0, ALL_PRIO0, "pynccl DDP + graph"]  # per grad-view setting
VIEW = " [view]"                                                  # suffix of gradient_as_bucket_view=True modes


def grad_view_settings(arg):
    return {"off": [False], "on": [True], "both": [False, True]}[arg]


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
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if not pynccl.is_initialized():
        pynccl.init_process_group("nccl", device_id=local_rank)
    torch_pg = tdist.new_group(backend="nccl")          # torch DDP's own NCCL communicator
    result = _measure(rank, world_size, args, device, torch_pg)
    if rank == 0 and args.torchrun:                     # torchrun: report before tearing down
        report(result, args)
    # NOTE: every trainer (and the CUDA graphs with captured collectives they hold) is gone with
    # _measure's frame: NCCL's finalize waits for graphs that still hold its operations.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pynccl.destroy_process_group()
    return result if rank == 0 else None


def _measure(rank, world_size, args, device, torch_pg):
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    batch = tuple(torch.randint(0, 50257, (args.batch, args.seq), generator=g).to(device) for _ in range(2))
    settings = grad_view_settings(args.grad_view)
    trainers = {}
    if args.compare_priority:                           # a communicator whose stream has normal priority
        os.environ["PYNCCL_COMM_STREAM_HIGH_PRIORITY"] = "0"
        args.prio0_group = pynccl.new_group()
        del os.environ["PYNCCL_COMM_STREAM_HIGH_PRIORITY"]
    for m in mode_names(settings, args.skip, args.compare_py_path, args.compare_priority):
        _progress(rank, f"building '{m}'")
        trainers[m] = Trainer(m, args, device, torch_pg, batch)
    for m, tr in trainers.items():
        _progress(rank, f"warm-up of '{m}'")
        for _ in range(args.warmup):
            tr.step()
        torch.cuda.synchronize()
    _progress(rank, "timing")
    times = {m: [] for m in trainers}
    host = {m: [] for m in trainers}
    for _ in range(args.repeats):                       # interleaved, so drift hits every mode alike
        for m, tr in trainers.items():
            times[m].extend(_events_ms(tr.step, args.steps, host[m]))
    gaps = profile_steps(trainers, args.profile, rank) if args.profile else None
    phases = measure_phases(trainers, args) if args.phases else None
    result = dict(world_size=world_size, device=torch.cuda.get_device_name(device), torch=torch.__version__,
                  nccl=str(pynccl.nccl_version()), precision=args.precision, batch=args.batch, seq=args.seq,
                  grad_view=settings, modes={}, gpu_gaps=gaps, phases=phases)
    for m, ts in times.items():
        result["modes"][m] = dict(median_ms=statistics.median(ts), min_ms=min(ts), max_ms=max(ts), n=len(ts),
                                  host_ms=statistics.median(host[m]))
    eager_name = next((m for m in trainers if m.startswith("pynccl DDP") and "graph" not in m), None)
    if eager_name is not None:
        eager = trainers[eager_name]
        result["num_params"] = eager.num_params
        result["profiled_mode"] = eager_name
        _progress(rank, "bucket timeline and per-bucket all-reduce")
        ready, bwd_ms = eager.profile_buckets()
        result["backward_ms"] = bwd_ms
        result["buckets"] = bucket_table(eager.ddp, ready, args.steps)
        _progress(rank, "pack kernel vs copy")
        result["pack"], result["pack_per_bucket"] = pack_vs_copy(eager.ddp, args.steps)
    return result


def print_report(r):
    views = {False: "False", True: "True"}
    print(f"# pynccl DDP benchmark: GPT-2 small ({r.get('num_params', 0) / 1e6:.1f}M params), batch {r['batch']}x"
          f"{r['seq']} tokens per rank, {r['precision']}{' autocast' if r['precision'] == 'bf16' else ''}, "
          f"world size {r['world_size']}, {r['device']}, torch {r['torch']}, NCCL {r['nccl']}, "
          f"gradient_as_bucket_view={' and '.join(views[v] for v in r['grad_view'])}"
          f"{' (modes marked' + VIEW + ': True, for both DDPs)' if True in r['grad_view'] else ''}")
    modes = r["modes"]

    def overhead(m):      # against no DDP run the same way (eager, or captured in a graph)
        base = modes.get("no DDP + graph" if "+ graph" in m else "no DDP", {}).get("median_ms")
        return (modes[m]["median_ms"] - base, base) if base else (float("nan"), float("nan"))

    print(f"{'mode':<28}{'median ms':>11}{'min':>9}{'max':>9}{'overhead ms':>13}{'overhead %':>12}"
          f"{'host ms':>9}")
    for m, s in modes.items():
        over, base = overhead(m)
        print(f"{m:<28}{s['median_ms']:>11.2f}{s['min_ms']:>9.2f}{s['max_ms']:>9.2f}{over:>13.3f}"
              f"{100 * over / base:>11.2f}%{s.get('host_ms', float('nan')):>9.2f}")
    print("# host ms: median time the step call took to return on the host (kernel launches, no sync); a step is "
          "host-bound where it approaches the step time")
    if r.get("phases"):
        print("# phases of eager steps (median ms): GPU time between events recorded at each phase's start, and the "
              "host time the phase's calls took")
        print(f"{'mode':<28}" + "".join(f"{'gpu ' + ph:>14}" for ph in PHASES) + "".join(f"{'host ' + ph:>15}" for ph in PHASES))
        for m, d in r["phases"].items():
            print(f"{m:<28}" + "".join(f"{d['gpu ' + ph]:>14.3f}" for ph in PHASES) +
                  "".join(f"{d['host ' + ph]:>15.3f}" for ph in PHASES))
    if r.get("gpu_gaps"):
        print("# profiled eager steps (torch.profiler, rank 0): GPU span per step, time per step no kernel ran, "
              "largest gaps (us, the kernel after the gap)")
        for m, g in r["gpu_gaps"].items():
            if g:
                print(f"#   {m:<24} span {g['span_ms']:.2f} ms, GPU idle {g['gpu_idle_ms']:.3f} ms; gaps {g['top_gaps_us'][:4]}")
    for v in r["grad_view"]:
        suffix = VIEW if v else ""
        if "torch DDP" + suffix not in modes:
            continue
        t_over = overhead("torch DDP" + suffix)[0]
        for m in modes:
            if m.startswith("pynccl DDP") and m.endswith(VIEW) == v:
                ratio = overhead(m)[0] / t_over if t_over > 0 else float("nan")
                t_min = modes["torch DDP" + suffix]["min_ms"] - modes["no DDP"]["min_ms"]
                base_min = modes.get("no DDP + graph" if "+ graph" in m else "no DDP", {}).get("min_ms", float("nan"))
                ratio_min = (modes[m]["min_ms"] - base_min) / t_min if t_min > 0 else float("nan")
                print(f"# gradient_as_bucket_view={views[v]}: {m} overhead / torch DDP{suffix} overhead = {ratio:.2f} "
                      f"(by minima {ratio_min:.2f}; target <= 0.5)")
    for m in modes:                                   # issue 10's measure at world size > 1
        if m.startswith("pynccl DDP") and "+ graph" not in m:
            ref = "torch DDP" + (VIEW if m.endswith(VIEW) else "")
            if ref in modes:
                print(f"# step time {m} / {ref} = {modes[m]['median_ms'] / modes[ref]['median_ms']:.3f} (medians; "
                      f"minima {modes[m]['min_ms'] / modes[ref]['min_ms']:.3f})")
    if "buckets" in r:
        print(f"\n# buckets of '{r['profiled_mode']}' (backward takes {r['backward_ms']:.2f} ms; 'ready at' = GPU time "
              f"from its start when the bucket's last gradient was made and the bucket handed on)")
        print(f"{'bucket':>6}{'params':>8}{'MiB':>9}{'ready at ms':>13}{'all-reduce us':>15}{'algbw GB/s':>12}"
              f"{'busbw GB/s':>12}")
        for b in r["buckets"]:
            ready = f"{b['ready_ms']:.2f}" if b["ready_ms"] is not None else "-"
            print(f"{b['bucket']:>6}{b['num_params']:>8}{b['mbytes']:>9.2f}{ready:>13}{b['allreduce_us']:>15.1f}"
                  f"{b['algbw_gbs']:>12.1f}{b['busbw_gbs']:>12.1f}")
        print("\n# pack kernel vs device-to-device copy (GB/s = bytes read + written per second)")
        print("# (a) all buckets at once: one pack launch PER BUCKET vs ONE copy of all the bytes (launch count differs)")
        copy = r["pack"]["device-to-device copy, all bytes, 1 launch"]["gbs"]
        for name, s in r["pack"].items():
            print(f"{name:<58}{s['ms']:>9.3f} ms{s['gbs']:>10.0f} GB/s{100 * s['gbs'] / copy:>8.1f}% of copy")
        rows = r["pack_per_bucket"]
        print("# (b) bucket by bucket: one pack (scale 1/world_size) / unpack launch vs one copy of that bucket's bytes "
              "(same launch count); % = copy time / kernel time")
        print(f"{'bucket':>6}{'tensors':>9}{'MiB':>9}{'pack us':>10}{'unpack us':>11}{'copy us':>10}{'pack %':>9}"
              f"{'unpack %':>10}")
        for b in rows:
            print(f"{b['bucket']:>6}{b['num_tensors']:>9}{b['mbytes']:>9.2f}{1e3 * b['pack_ms']:>10.1f}"
                  f"{1e3 * b['unpack_ms']:>11.1f}{1e3 * b['copy_ms']:>10.1f}{100 * b['copy_ms'] / b['pack_ms']:>8.1f}%"
                  f"{100 * b['copy_ms'] / b['unpack_ms']:>9.1f}%")
        pack_sum, unpack_sum, copy_sum = (sum(b[k] for b in rows) for k in ("pack_ms", "unpack_ms", "copy_ms"))
        print(f"# sum over buckets: pack {pack_sum:.3f} ms, unpack {unpack_sum:.3f} ms, copy {copy_sum:.3f} ms -> "
              f"pack {100 * copy_sum / pack_sum:.1f}% and unpack {100 * copy_sum / unpack_sum:.1f}% of copy bandwidth "
              f"(target >= 80%)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--grad-view", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="gradient_as_bucket_view for both DDPs: --grad-view (= on) True, 'both' runs the DDP modes "
                        "under False and True in one process (no-DDP baselines shared)")
    p.add_argument("--skip", nargs="*", default=[], choices=MODES, help="modes to leave out")
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
    args.prio0_group = None                             # set in the workers by --compare-priority
    if not torch.cuda.is_available():
        sys.exit("ddp_bench: needs CUDA GPUs (pynccl DDP on gloo is exercised by tests/test_ddp.py)")
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
    sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
