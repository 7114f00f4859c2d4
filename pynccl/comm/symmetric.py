"""Symmetric memory: buffers NCCL's low-SM collectives run on (issue 26).

A collective whose send and receive buffers lie in NCCL_WIN_COLL_SYMMETRIC windows (memory from
ncclMemAlloc, registered on every rank at the same size) runs NCCL's symmetric kernels: a few
CTAs instead of one per channel, fp32 accumulation for bf16/fp16 (NCCL >= 2.27). On a
communicator with CTAPolicy ZERO (pynccl's default where NCCL >= 2.28) an all-gather on such
buffers runs on the copy engines and holds no SM at all. DDP's buckets and ZeRO's flat buffers
come from here when every requirement holds; otherwise they stay ordinary torch tensors, with
the reason kept in `SymmetricSupport.reason` (benchmarks print it in their header).

NOTE: the decision is collective. If one rank's buffer were in a window and another's not, the
two would run different kernels for one collective and hang, so every rank checks its own
requirements and one all-reduce takes the answer of the worst rank.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from typing import List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _ext
from .groups import ProcessGroup
from .reduce_op import ReduceOp

# A window's base is page aligned; every buffer cut from one starts at a multiple of this, so
# views of any dtype stay aligned for the kernels' vector loads.
ALIGN_BYTES = 4096
_WINDOW_VERSION = (2, 27, 0)
_COPY_ENGINE_VERSION = (2, 28, 0)
_CTA_POLICY_ZERO = 2

# Reasons a rank reports, by code (the lowest rank's code is the answer everyone prints).
_REASONS = [
    "",                                                                    # 0: available
    "disabled by PYNCCL_SYMMETRIC=0",
    "not the nccl backend",
    "one rank: no collective to speed up",
    "needs NCCL >= 2.27 at build and run time",
    "NCCL_CUMEM_ENABLE=0 (symmetric windows need cuMem allocations)",
    "NCCL_WIN_ENABLE=0",
    "ranks on more than one host (symmetric kernels need one NVLink domain)",
    "no CUDA P2P access between two ranks' GPUs",
    "ncclCommWindowRegister gave no window (NCCL found no symmetric support in this communicator)",
]


@dataclasses.dataclass(frozen=True)
class SymmetricSupport:
    """available: collectives on alloc_symmetric's buffers run NCCL's symmetric kernels.
    copy_engine: all-gathers on them run on the copy engines (CTAPolicy ZERO, NCCL >= 2.28).
    reason: why not (empty when available)."""

    available: bool
    copy_engine: bool
    reason: str

    def describe(self) -> str:
        if not self.available:
            return f"off ({self.reason})"
        return "symmetric kernels" + ("; all-gathers on the copy engines" if self.copy_engine else "")


def _enabled_by_env() -> bool:
    return os.environ.get("PYNCCL_SYMMETRIC", "1").strip().lower() not in ("0", "false", "off", "no")


def _local_reason(group: ProcessGroup) -> int:
    """This rank's first missing requirement (an index into _REASONS), topology aside."""
    if not _enabled_by_env():
        return 1
    if group.backend_name != "nccl":
        return 2
    if group.backend.world_size == 1:
        return 3
    version = _ext.nccl_version()
    if min(version.build, version.runtime) < _WINDOW_VERSION:
        return 4
    if os.environ.get("NCCL_CUMEM_ENABLE", "").strip() == "0":
        return 5
    if os.environ.get("NCCL_WIN_ENABLE", "").strip() == "0":
        return 6
    return 0


def _host_id() -> int:
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def _topology_reason(group: ProcessGroup) -> int:
    """Collective: every rank on one host, with P2P access to every other rank's GPU."""
    device = group.backend.device
    mine = torch.tensor([_host_id(), device.index], dtype=torch.int64, device=device)
    everyone = torch.empty(2 * group.backend.world_size, dtype=torch.int64, device=device)
    group.backend.all_gather_into_tensor(everyone, mine)
    hosts, devices = everyone.view(-1, 2).t().tolist()
    if len(set(hosts)) > 1:
        return 7
    for other in devices:
        if other != device.index and not torch.cuda.can_device_access_peer(device.index, other):
            return 8
    return 0


def _agree(group: ProcessGroup, code: int) -> int:
    """Collective: the code of the lowest rank that has one (0 if none)."""
    backend, n = group.backend, len(_REASONS)
    # A failing rank r sends r * n + code, the others world_size * n: the minimum names the
    # lowest failing rank and its code.
    key = backend.rank * n + code if code else backend.world_size * n
    t = torch.tensor([key], dtype=torch.int64, device=backend.device)
    backend.all_reduce(t, ReduceOp.MIN)
    key = int(t.item())
    return 0 if key >= backend.world_size * n else key % n


def symmetric_support(group: ProcessGroup) -> SymmetricSupport:
    """Collective the first time per group (cached on it): whether alloc_symmetric can be used."""
    cached = getattr(group, "_symmetric_support", None)
    if cached is not None:
        return cached
    code = _local_reason(group)
    if code in (2, 3):                     # the same on every rank, and no NCCL collective to ask with
        support = SymmetricSupport(False, False, _REASONS[code])
    else:
        if code == 0:
            code = _topology_reason(group)
        code = _agree(group, code)
        comm = getattr(group.backend, "comm", None)
        copy_engine = (code == 0 and _ext.nccl_version().runtime >= _COPY_ENGINE_VERSION
                       and getattr(comm, "cta_policy", -1) == _CTA_POLICY_ZERO)
        support = SymmetricSupport(code == 0, copy_engine, _REASONS[code])
    group._symmetric_support = support
    return support


# Windows this process allocated, while alive: (weak reference to the storage, bytes). Their memory
# comes from ncclMemAlloc, outside torch's caching allocator: torch.cuda.memory_allocated and
# max_memory_allocated never count it, so memory reports add window_bytes() (issue 26).
_windows: List[Tuple[StorageWeakRef, int]] = []


def track_window(window: torch.Tensor) -> None:
    """Count `window`'s storage in window_bytes() for as long as it lives."""
    _windows[:] = [(ref, n) for ref, n in _windows if not ref.expired()]
    _windows.append((StorageWeakRef(window.untyped_storage()), window.untyped_storage().nbytes()))


def window_bytes() -> int:
    """Bytes of the symmetric windows (alloc_symmetric) alive in this process: device memory
    torch's allocator statistics leave out (a window lives as long as any buffer cut from it)."""
    return sum(n for ref, n in _windows if not ref.expired())


def _layout(sizes: Sequence[Tuple[int, torch.dtype]]) -> Tuple[List[int], int]:
    """Byte offsets of each (numel, dtype) buffer, each aligned, and the total."""
    offsets, total = [], 0
    for numel, dtype in sizes:
        offsets.append(total)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        total += (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
    return offsets, max(total, ALIGN_BYTES)


# Free device memory a window must leave beyond its own size: ncclMemAlloc rounds up to its
# allocation granularity, and registration maps the peers' windows.
_WINDOW_MARGIN_BYTES = 32 * 2**20


def _free_device_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 62


def _agree_on_window(group: ProcessGroup, offsets: List[int], total: int) -> Tuple[bool, Optional[Tuple[int, int]]]:
    """Collective, one all-reduce: (every rank asked for the same layout, as a symmetric
    collective needs the same offsets everywhere; None, or (rank, free bytes) of the lowest rank
    without room for the window). NOTE: ncclMemAlloc is local and registration collective, so a
    rank whose allocation failed alone would leave the others waiting in registration until the
    watchdog ends them: every rank checks its free memory first and all fall back together."""
    backend = group.backend
    digest = hashlib.blake2b(repr((offsets, total)).encode(), digest_size=7).digest()
    h = int.from_bytes(digest, "little")
    free = _free_device_bytes(backend.device)
    short = free < total + _WINDOW_MARGIN_BYTES
    # NOTE: MAX of (world - rank) names the lowest short rank; its free bytes ride in a slot of their own.
    values = [h, -h, 0] + [0] * backend.world_size
    if short:
        values[2] = backend.world_size - backend.rank
        values[3 + backend.rank] = free
    t = torch.tensor(values, dtype=torch.int64, device=backend.device)
    backend.all_reduce(t, ReduceOp.MAX)
    values = t.tolist()
    same = values[0] == h and values[1] == -h
    if values[2] == 0:
        return same, None
    rank = backend.world_size - values[2]
    return same, (rank, values[3 + rank])


def alloc_symmetric(group: ProcessGroup, sizes: Sequence[Tuple[int, torch.dtype]]) -> Optional[List[torch.Tensor]]:
    """Collective: one symmetric window holding a buffer per (numel, dtype) of `sizes`, zeroed,
    at the same offsets on every rank; None (on every rank) where symmetric_support(group) is
    off, the ranks asked for different layouts or a rank has no room for it (then the group's
    support is off, with that reason). The window lives as long as any buffer."""
    if not symmetric_support(group).available:
        return None
    offsets, total = _layout(sizes)
    same, short = _agree_on_window(group, offsets, total)
    if not same:
        group._symmetric_support = SymmetricSupport(False, False, "ranks asked for different buffer layouts")
        return None
    if short is not None:
        rank, free = short
        group._symmetric_support = SymmetricSupport(
            False, False, f"rank {rank} has {free / 2**20:.0f} MiB of device memory free; a window of "
                          f"{total / 2**20:.0f} MiB (+{_WINDOW_MARGIN_BYTES // 2**20} MiB) does not fit")
        return None
    try:
        window = group.backend.comm.alloc_symmetric(total)
    except ValueError as e:                # NCCL gave no window: the same on every rank
        group._symmetric_support = SymmetricSupport(False, False, f"{_REASONS[9]}: {e}")
        return None
    window.zero_()
    track_window(window)
    return [window[o: o + numel * torch.empty(0, dtype=dtype).element_size()].view(dtype)
            for o, (numel, dtype) in zip(offsets, sizes)]


_SCRATCH_ROUND_BYTES = 1 << 20


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def scratch_window(group: ProcessGroup, key: str, nbytes: int) -> Optional[torch.Tensor]:
    """A uint8 symmetric window of at least nbytes kept on the group under `key` (one per key,
    grown as asked, rounded up to 1 MiB), or None: no symmetric memory on the group, a larger one
    needed while a CUDA graph is being captured (never allocated there: allocation is collective and
    synchronizes the host), or none could be had (a smaller window is kept for the sizes it fits).
    Collective when it allocates: callers must ask on every rank in the same order with the same
    sizes (as ops every rank runs alike do). Its user must be done with it (in stream order) before
    the next use. A window handed out while a CUDA graph is captured stays allocated as long as the
    group, even once a larger one replaces it under its key: the graph holds its address."""
    state = getattr(group, "_scratch_windows", None)
    if state is None:
        state = group._scratch_windows = {}
    window, unavailable = state.get(key, (None, False))
    if window is not None and window.numel() >= nbytes:
        if _capturing():
            kept = group.__dict__.setdefault("_scratch_windows_in_graphs", [])
            if not any(w is window for w in kept):
                kept.append(window)
        return window
    if unavailable or _capturing():
        return None
    bufs = alloc_symmetric(group, [(-(-nbytes // _SCRATCH_ROUND_BYTES) * _SCRATCH_ROUND_BYTES, torch.uint8)])
    if bufs is None:    # the same answer on every rank (alloc_symmetric agrees collectively)
        state[key] = (window, True)
        return None
    state[key] = (bufs[0], False)
    return bufs[0]

