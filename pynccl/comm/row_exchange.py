"""Move parameter rows between two partitions of them over the ranks of a group, with one
all_to_all_single: e.g. ZeRO's flat layout (zero/row_exchange.py) or TP's fused shards <-> torch's
even Shard(0) chunks (what DTensor, FSDP2 and DCP use).

ZeRO gives each rank some contiguous range of each parameter's rows, wherever the unit's equal
flat shards cut (layout.py): uneven per parameter, and a parameter may lie on one rank only.
torch's DTensor Shard(0) (FSDP2's state dicts, and what DCP's planner computes offsets from)
gives rank r rows [r·c, (r+1)·c) ∩ [0, rows) with c = ceil(rows / world_size), as torch.chunk.
A checkpoint must hold the latter to load into FSDP2 or at another world size, so rows move
both ways: flat -> chunks when a state dict is taken, chunks -> flat when one is loaded.

Every rank derives the whole plan (who sends which rows to whom) from the partitions alone,
which every rank knows, so the exchange needs no metadata round. Each rank sends and receives
about its own shard of the unit: memory stays bounded by a shard, never by a full parameter.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch

from . import distributed as dist

# Rows of one parameter a rank holds (or wants): ranges in the order the rank stores them.
Rows = List[range]


def chunk_rows(num_rows: int, world_size: int, rank: int) -> range:
    """torch.chunk's / DTensor Shard(0)'s rows of `rank`: ceil(rows / world) each, the last ones
    shorter or empty."""
    c = math.ceil(num_rows / world_size) if num_rows else 0
    return range(min(rank * c, num_rows), min((rank + 1) * c, num_rows))


def num_rows(shape: torch.Size) -> int:
    """Rows of a parameter (a 0-d parameter is one row of one element)."""
    return shape[0] if len(shape) else 1


def _pieces(src: Rows, dst: Rows):
    """(offset in the source's rows, offset in the destination's rows, length) of every run of
    rows that `src` holds and `dst` wants, in a fixed order both sides compute alike."""
    out, src_pos = [], 0
    for s in src:
        dst_pos = 0
        for d in dst:
            lo, hi = max(s.start, d.start), min(s.stop, d.stop)
            if lo < hi:
                out.append((src_pos + lo - s.start, dst_pos + lo - d.start, hi - lo))
            dst_pos += len(d)
        src_pos += len(s)
    return out


def exchange_rows(group, sources: Sequence[torch.Tensor], row_shapes: Sequence[tuple],
                  src_rows: Sequence[Sequence[Rows]], dst_rows: Sequence[Sequence[Rows]]) -> List[torch.Tensor]:
    """Move rows of several parameters from one partition to another. Collective over `group`.

    sources[s]: this rank's rows of parameter s in the source partition (any shape with that many
    rows' elements; a 0-d parameter counts as one row), all of one dtype and device.
    row_shapes[s]: the shape of one row of parameter s (shape[1:]; () for 0-d and 1-d).
    src_rows[s][r] / dst_rows[s][r]: the rows rank r holds / wants of parameter s. Source ranges of
    one parameter must not overlap across ranks; destination ranges may (several ranks wanting the
    same rows: a replicated 0-d parameter). Rows wanted but held by no rank stay uninitialised,
    so callers pass source partitions that cover what is wanted.
    Returns per parameter this rank's wanted rows, shaped (wanted rows, *row_shapes[s])."""
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    ref = sources[0]
    row_numel = [math.prod(r) for r in row_shapes]
    send_parts, send_sizes, recv_sizes = [], [0] * ws, [0] * ws
    recv_plan = []                                          # (source rank, param, dst row offset, rows)
    for peer in range(ws):
        for s, src in enumerate(sources):
            flat, q = src.reshape(-1), row_numel[s]
            for src_off, _, n in _pieces(src_rows[s][rank], dst_rows[s][peer]):
                send_parts.append(flat[src_off * q: (src_off + n) * q])
                send_sizes[peer] += n * q
            for _, dst_off, n in _pieces(src_rows[s][peer], dst_rows[s][rank]):
                recv_plan.append((peer, s, dst_off, n))
                recv_sizes[peer] += n * q
    outs = [torch.empty((sum(len(r) for r in dst_rows[s][rank]),) + tuple(row_shapes[s]), dtype=ref.dtype,
                        device=ref.device) for s in range(len(sources))]
    send = torch.cat(send_parts) if send_parts else ref.new_empty(0)
    recv = ref.new_empty(sum(recv_sizes))
    # NOTE: always called, even with nothing to move: every rank must reach the collective.
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    del send
    starts = [sum(recv_sizes[:peer]) for peer in range(ws)]
    for peer, s, dst_off, n in recv_plan:                   # per source rank, in its send order
        q = row_numel[s]
        outs[s].view(-1)[dst_off * q: (dst_off + n) * q].copy_(recv[starts[peer]: starts[peer] + n * q])
        starts[peer] += n * q
    return outs
