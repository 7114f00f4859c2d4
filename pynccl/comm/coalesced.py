"""Many small tensors moved as a few flat buffers: grouping tensors into buckets by (dtype, device)
under a byte cap, and the coalesced broadcast from rank 0 that DDP and ZeRO use to start every
rank from the same module state. One collective per bucket instead of one per tensor.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

MiB = 1024 * 1024


def assign_buckets(tensors: Sequence[torch.Tensor], first_cap_bytes: int, cap_bytes: int) -> List[List[int]]:
    """Positions into `tensors`, grouped into buckets.

    Pure logic (no processes, works on meta tensors): walks `tensors` in the given order, one open
    bucket per (dtype, device); a bucket closes once it holds >= its cap (the first bucket of each
    key `first_cap_bytes`, later ones `cap_bytes`); a tensor of `cap_bytes` or more gets a bucket of
    its own (the open bucket closes before it, under its cap). Buckets come back in the order they
    would become ready if gradients arrived in the given order (sorted by their last member)."""
    if first_cap_bytes <= 0 or cap_bytes <= 0:
        raise ValueError(f"assign_buckets: caps must be positive, got first_cap_bytes={first_cap_bytes}, "
                         f"cap_bytes={cap_bytes}")
    open_buckets: Dict[tuple, List[int]] = {}
    open_bytes: Dict[tuple, int] = {}
    num_closed: Dict[tuple, int] = {}
    closed: List[List[int]] = []
    def close(key) -> None:
        closed.append(open_buckets.pop(key))
        open_bytes.pop(key)
        num_closed[key] = num_closed.get(key, 0) + 1

    for pos, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if nbytes >= cap_bytes and open_buckets.get(key):
            # NOTE: an oversized tensor (a tied embedding) goes alone: the small tensors before
            # it are reduced while its gradient is still being computed, not after.
            close(key)
        cap = first_cap_bytes if num_closed.get(key, 0) == 0 else cap_bytes
        open_buckets.setdefault(key, []).append(pos)
        open_bytes[key] = open_bytes.get(key, 0) + nbytes
        if open_bytes[key] >= cap:
            close(key)
    closed.extend(b for b in open_buckets.values() if b)
    # A bucket is ready when its last member is: that is the order they are reduced in.
    closed.sort(key=lambda b: b[-1])
    return closed


_BROADCAST_CAP_BYTES = 250 * MiB


def coalesced_broadcaster(tensors: Sequence[torch.Tensor]) -> Callable:
    """A function (backend, src=0) -> None that broadcasts `tensors` in place from group rank
    `src`: one collective per dtype group (up to 250 MiB each) into buffers allocated here, once."""
    groups = []
    for idxs in assign_buckets(tensors, _BROADCAST_CAP_BYTES, _BROADCAST_CAP_BYTES):
        ts = [tensors[i] for i in idxs]
        flat = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
        groups.append((ts, flat))

    @torch.no_grad()
    def broadcast(backend, src: int = 0) -> None:
        for ts, flat in groups:
            if backend.rank == src:
                backend.pack(ts, flat, 1.0)
            backend.broadcast(flat, src)
            if backend.rank != src:
                backend.unpack(flat, ts, 1.0)
    return broadcast


def broadcast_from_rank0(backend, tensors: Sequence[torch.Tensor]) -> None:
    if tensors:
        coalesced_broadcaster(tensors)(backend)
