"""CUDA-only diagnostics of ddp_bench: each bucket's all-reduce alone and when it became ready,
the pack kernel against a copy of the same bytes, per-phase times of eager steps, and where a
profiled step left the GPU idle (torch.profiler).
"""
import json
import os
import statistics

import torch

import pynccl

from .trainer import step_times_ms


def bucket_table(ddp, ready_ms, iters):
    """Each bucket's all-reduce alone (CUDA events around it, median of `iters`)."""
    rows = []
    ws = pynccl.get_world_size()
    for b in ddp.reducer.bucketer.buckets:
        wire = b.extra["wire"]
        times = step_times_ms(lambda: pynccl.all_reduce(wire), iters, wire.device)
        t = statistics.median(times)
        nbytes = wire.numel() * wire.element_size()
        algbw = nbytes / (t * 1e-3) / 1e9
        rows.append(dict(bucket=b.index, num_params=len(b.params), mbytes=nbytes / 2**20, ready_ms=ready_ms.get(b.index),
                         allreduce_us=t * 1e3, busbw_gbs=algbw * 2 * (ws - 1) / ws, algbw_gbs=algbw))
    return rows


def _timed(fn, iters):
    for _ in range(3):
        fn()
    return statistics.median(step_times_ms(fn, iters, torch.device("cuda")))


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
    interleaved in 5 rounds): where an eager overhead sits. pynccl DDP's backward is split further
    (Trainer._backward_events): "gpu bwd compute" until the last compute kernel, "gpu bwd wait"
    until every bucket's reduction has ended on the compute stream, "gpu bwd rows" the tied rows'
    exchange; and per bucket (hand-out order) when its gradients were ready and when its reduction
    ended, in ms after backward began."""
    out = {m: {f"{k} {ph}": [] for k in ("gpu", "host") for ph in PHASES} for m in trainers if "graph" not in m}
    buckets = {m: {} for m in out}
    for _ in range(5):
        for m in out:
            recs = [trainers[m].phase_step() for _ in range(max(1, args.phases // 5))]
            torch.cuda.synchronize()
            for ev, host, marks in recs:
                for i, ph in enumerate(PHASES):
                    out[m][f"gpu {ph}"].append(ev[i].elapsed_time(ev[i + 1]))
                    out[m][f"host {ph}"].append(1e3 * (host[i + 1] - host[i]))
                if "compute" not in marks:
                    continue
                split = [("gpu bwd compute", ev[1], marks["compute"]), ("gpu bwd wait", marks["compute"], marks["written"]),
                         ("gpu bwd rows", marks["written"], marks["end"])]
                for name, a, b in split:
                    out[m].setdefault(name, []).append(a.elapsed_time(b))
                for pos, (index, ready, done) in enumerate(marks["buckets"]):
                    row = buckets[m].setdefault(pos, dict(bucket=index, ready=[], done=[]))
                    row["ready"].append(ev[1].elapsed_time(ready))
                    row["done"].append(ev[1].elapsed_time(done))
    result = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in out.items()}
    for m, rows in buckets.items():
        if rows:
            result[m]["buckets"] = [dict(bucket=r["bucket"], ready_ms=statistics.median(r["ready"]),
                                         done_ms=statistics.median(r["done"])) for _, r in sorted(rows.items())]
    return result


def profile_steps(trainers, outdir, rank, steps=3):
    """torch.profiler over `steps` eager steps of each eager mode: where the GPU sat idle. Writes
    <outdir>/trace_<mode>_rank<r>.json.gz (every rank) and returns {mode: summary}."""
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
        slug = "".join(c if c.isalnum() or c in "-_" else "_" for c in m)
        path = os.path.join(outdir, f"trace_{slug}_rank{rank}.json")
        prof.export_chrome_trace(path)
        out[m] = _gap_summary(_kernel_timeline(path), steps)
        # NOTE: every rank's trace: a collective's time on one rank is mostly waiting for the slowest.
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
    return out

