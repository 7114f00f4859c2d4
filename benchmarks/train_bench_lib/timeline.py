"""--timeline for the pipeline pairs: after the timed steps, a barrier, then STEADY steps back to
back (as the timed ones run: no barrier between steps) in which every forward and backward of a
micro-batch is timed on the GPU (CUDA events) and on the host (when the schedule called it);
rank 0 prints each rank's actions of the last of them, in ms from that step's first action on
any rank (each rank's clock starts at the barrier, so ranks line up within its skew), and the
GPU time between them (waiting for a message, or for the host). Either side: pynccl's schedules take a compute_timer;
torch.distributed.pipelining's stages get their forward_one_chunk / backward_one_chunk wrapped.

Benchmark-only: the events add a few microseconds per action; the timed steps run without them.
"""
from __future__ import annotations

import contextlib
import time
from typing import List, Tuple

import torch
import torch.distributed as tdist


class Timeline:
    def __init__(self):
        self.spans: List[Tuple[str, torch.cuda.Event, torch.cuda.Event, float]] = []
        self.t0_host = 0.0
        self.start = torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        self.spans.clear()
        self.start.record()
        self.t0_host = time.perf_counter()

    @contextlib.contextmanager
    def span(self, name: str):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = 1e3 * (time.perf_counter() - self.t0_host)
        s.record()
        try:
            yield
        finally:
            e.record()
            self.spans.append((name, s, e, host))

    def rows(self) -> List[Tuple[str, float, float, float]]:
        """(name, GPU start ms, GPU end ms, host call ms), after a synchronize."""
        return [(n, self.start.elapsed_time(s), self.start.elapsed_time(e), h) for n, s, e, h in self.spans]


def install(sched, stages, timeline: Timeline) -> None:
    """Time every compute action of `sched` (pynccl) or of `stages` (torch.distributed.pipelining)."""
    if hasattr(sched, "compute_timer"):
        sched.compute_timer = lambda a: timeline.span(f"{a.type.value}{a.microbatch}")
        return
    for st in stages:
        fwd, bwd = st.forward_one_chunk, st.backward_one_chunk

        def timed_fwd(chunk_id, *a, _f=fwd, **k):
            with timeline.span(f"F{chunk_id}"):
                return _f(chunk_id, *a, **k)

        def timed_bwd(chunk_id, *a, _f=bwd, **k):
            with timeline.span(f"B{chunk_id}"):
                return _f(chunk_id, *a, **k)
        st.forward_one_chunk, st.backward_one_chunk = timed_fwd, timed_bwd


STEADY = 3


def run_and_print(trainer, tl: Timeline, ctx, title: str) -> None:
    """STEADY timed-action steps on every rank; rank 0 prints all ranks' timelines of the last one.
    Collective."""
    torch.cuda.synchronize()
    tdist.barrier()
    tl.begin()
    ends = []
    for i in range(STEADY):
        if i == STEADY - 1:
            tl.spans.clear()
        trainer.step()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        ends.append(e)
        torch.cuda.synchronize()                # as the timed steps do
    rows = tl.rows()
    end = tl.start.elapsed_time(ends[-1])
    gathered = [None] * ctx.world_size
    tdist.all_gather_object(gathered, (rows, end))
    if ctx.rank != 0:
        return
    origin = min(rows[0][1] for rows, _ in gathered if rows)
    host_origin = min(rows[0][3] for rows, _ in gathered if rows)
    print(f"# timeline of step {STEADY} of {STEADY} run back to back, {title}: action GPU start-end ms (host call ms), "
          f"from the step's first action on any rank; '+g' = GPU idle before it")
    for r, (rows, end) in enumerate(gathered):
        busy = sum(e - s for _, s, e, _ in rows)
        parts, prev = [], None
        for name, s, e, h in rows:
            s, e, h = s - origin, e - origin, h - host_origin
            gap = 0.0 if prev is None else s - prev
            parts.append(f"{name} {s:.1f}-{e:.1f} ({h:.1f})" + (f" +{gap:.1f}" if gap > 0.05 else ""))
            prev = e
        print(f"# rank {r}: compute {busy:.1f} ms, step ends at {end - origin:.1f}; " + ", ".join(parts))
