"""How far ZeRO-3's backward may run ahead of the GPU on the host.

Autograd enqueues a block's backward (and, with activation checkpointing, its recomputation) far
faster than the GPU runs it, so the host can be many blocks ahead. Every block the host has passed
holds its fp32 reduce-scatter input until the host sees that reduce complete (flat_unit.ReduceQueue
frees only completed reduces, never waiting): on a checkpointed 1.1B Llama at dp 2 that was about 8
blocks, 1.82 GiB above FSDP2's peak (benchmarks/RESULTS.md, ZeRO).

FSDP2 bounds this by making the compute stream wait for the previous reduce-scatter. pynccl cannot:
a rank whose backward skipped a block starts that block's reduce only at the end of its backward
(stage3.py), and a compute stream waiting for it would hold back this rank's all-gathers, which
the other rank needs to get there: a hang on NCCL. Waiting for reduces on the host hangs the same
way. So the host is paced on its own compute stream instead: at each block's backward, before
enqueuing it, the host waits until the GPU has reached the backward of the block `lead` blocks
back. That wait depends on no reduce-scatter, only on compute and on all-gathers this rank has
already started (prefetch comes before the wait), and the peers start their matching gathers as
long as their hosts move. One thing can stop a peer's host: NCCL connects a communicator's
algorithm on its first use, and that call blocks on the host until every rank makes it. A peer
whose first reduce-scatter waits for this rank's deferred one, while this rank waits here for a
gather that peer has not started, would hang. So connect_reduce_paths runs
each reduce the model will run (every unit size; hybrid, the replicas' all-reduce too) once at
wrap time, on every rank alike, and a reduce call no longer blocks the host in backward. The
reduces the GPU has finished by the wait are freed right after it. With lead L,
about L + 2 reduce inputs are alive (blocks k+1 .. k+L, the one just started, and at most one
still running when the reduce stream keeps up) instead of every block the host ran ahead.

PYNCCL_ZERO3_BACKWARD_LEAD sets L (default DEFAULT_LEAD; 0 turns pacing off). Off on CPU (nothing
runs ahead there), while a CUDA graph is being captured (no host wait is allowed then) and in a
backward that does not reduce (gradient accumulation: nothing to bound; stage3.py).

The wait polls the event, bounded: where the GPU is stuck (an all-gather whose peer died), the
group's watchdog acts at its timeout (ends the process, or aborts the communicator, which ends the
stuck kernel); should the GPU still not get there by twice that timeout, PacingTimeoutError (a
PyncclError and a TimeoutError), not a hang. The bound knows only the ZeRO group's timeout: a
block whose backward waits on another group's collective for longer (TP, pipeline) needs a ZeRO
group timeout at least that long, or the pacing off.

connect_reduce_paths runs on CUDA whatever the lead: whether a rank runs these collectives must not
depend on its own environment (a rank with pacing off would skip them, and its first real reduce
would pair with a peer's zeros).
"""
from __future__ import annotations

import collections
import os
import time

import torch

from ..errors import PacingTimeoutError


DEFAULT_LEAD = 2
ENV = "PYNCCL_ZERO3_BACKWARD_LEAD"


def lead_from_env() -> int:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_LEAD
    try:
        lead = int(raw)
    except ValueError:
        lead = -1
    if lead < 0:
        raise ValueError(f"{ENV} must be a whole number of blocks >= 0 (0: no pacing), got {raw!r}")
    return lead


class BackwardPacer:
    """One per ZeRO-3 runtime. reset() at the start of each backward; block(index) at each unit's
    backward, before its work is enqueued: returns True when it waited (the caller then frees the
    reduces that have completed). A unit announced twice in a row (reentrant checkpointing hooks
    the recomputed outputs again) counts once."""

    POLL_S = 1e-4

    def __init__(self, device: torch.device, lead: int, timeout_s: float):
        self.lead = lead if device.type == "cuda" else 0
        self.timeout_s = timeout_s
        self._events: collections.deque = collections.deque()
        self._last_index = None
        self.waits = 0                       # host waits so far (tests and diagnostics)

    def reset(self) -> None:
        self._events.clear()
        self._last_index = None

    def block(self, index: int) -> bool:
        if self.lead == 0 or index == self._last_index or torch.cuda.is_current_stream_capturing():
            return False
        self._last_index = index
        event = torch.cuda.Event()
        event.record()
        self._events.append((index, event))
        if len(self._events) <= self.lead:
            return False
        self._wait(*self._events.popleft(), index)
        self.waits += 1
        return True

    def _wait(self, earlier: int, event: torch.cuda.Event, index: int) -> None:
        deadline = time.monotonic() + 2 * self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise PacingTimeoutError(
                    f"ZeRO-3 backward: before unit {index}'s backward, the GPU did not reach unit {earlier}'s "
                    f"backward ({self.lead} back) within {2 * self.timeout_s:g} s (twice the ZeRO group's timeout; "
                    f"a collective of another group stuck in that block, or a dead peer; {ENV}=0 turns this "
                    f"pacing off)")
            time.sleep(self.POLL_S)


def connect_reduce_paths(units, device_types=("cuda",)) -> int:
    """Collective over the units' groups, at wrap time, the same on every rank: one reduce of zeros
    per distinct (size, dtype) of the units' gradient reduces, through the unit's own reduce_grad
    (and, hybrid, its all-reduce across replicas), so that NCCL has connected every algorithm
    backward will use (see above).
    Units on other device types are left out (gloo connects at init). Returns the reduces run."""
    seen = set()
    for u in units:
        key = (u.layout.padded_numel, u.reduce_dtype)
        # NOTE: hybrid with a shard group of one still all-reduces across the replicas.
        if key in seen or u.full.device.type not in device_types or \
                (u.reduce_group.world_size == 1 and u.replicate_group is None):
            continue
        seen.add(key)
        pending = u.reduce_grad([torch.zeros(u.layout.padded_numel, dtype=u.reduce_dtype, device=u.full.device)])
        if pending.replicas_left:
            u.reduce_across_replicas(pending)
        pending.work.wait()                              # finish_reduce without adding to .grad
    return len(seen)
