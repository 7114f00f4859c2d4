"""ZeRO's flat layout as rows (flat_rows), for comm/row_exchange.py's exchange: every rank holds
some contiguous range of each parameter's rows, wherever the unit's equal flat shards cut."""
from __future__ import annotations

from typing import List

from ..comm.row_exchange import Rows, _pieces, chunk_rows, exchange_rows, num_rows  # noqa: F401 - the exchange
from .layout import FlatLayout


def flat_rows(layout: FlatLayout, rank: int) -> List[range]:
    """Per slot, the rows of that parameter in `rank`'s flat shard (empty where it holds none)."""
    held = {p.slot_idx: p for p in layout.shard_pieces(rank)}
    out = []
    for i, slot in enumerate(layout.slots):
        p = held.get(i)
        if p is None:
            out.append(range(0))
        else:
            q = slot.row_numel
            out.append(range(p.param_start // q, (p.param_start + p.numel) // q))
    return out
