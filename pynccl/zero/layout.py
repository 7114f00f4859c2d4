"""Flat shard layout: where each parameter of a unit sits in the unit's flat buffer, and which
equal-sized slice of that buffer each rank owns. Pure index arithmetic (no processes, no
data), so it is unit-tested directly; everything that moves data (gather, reduce-scatter,
checkpoints, resharding) reads positions from here and nowhere else.

    flat buffer (world_size equal shards; padding is zero):
    | p0 ........ |pad| p1 ......... | p2 .............. |pad|
    | rank 0 shard      | rank 1 shard      | rank 2 shard      |

Shard boundaries fall between rows: a parameter of shape (rows, *rest) that crosses a
boundary is placed so the boundary lands on a multiple of its row size (padding goes in
front of it, never inside it). So every rank's part of every parameter is a contiguous
range of whole rows, i.e. a tensor of shape (local_rows, *rest) with the original number
of dimensions: that is what the optimizer sees (param groups by name and p.dim() work
unchanged), while gather and reduce-scatter still move one flat buffer with no copy.
The price is a little padding: less than one row per boundary, plus rounding the shard
size up to a multiple of the row size of any parameter that spans two boundaries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter inside a flat unit."""

    name: str                 # first fully qualified name in the wrapped module
    shape: torch.Size
    offset: int               # element offset in the unit's flat buffer
    numel: int
    param_index: int          # position in the original module.parameters() (checkpoint keys)

    @property
    def row_numel(self) -> int:
        """Elements of one dim-0 row (1 for 0-d and 1-d parameters)."""
        return max(1, math.prod(self.shape[1:])) if len(self.shape) > 1 else 1


class ShardPiece(NamedTuple):
    """The part of parameter `slot_idx` that lies in one rank's shard."""

    slot_idx: int
    param_start: int          # element offset inside the (flattened) parameter
    shard_start: int          # element offset inside the shard
    numel: int


def _row_numel(shape: torch.Size) -> int:
    return max(1, math.prod(shape[1:])) if len(shape) > 1 else 1


def _place(numels: Sequence[int], rows: Sequence[int], shard_numel: int, world_size: int):
    """Offsets that put every shard boundary a parameter crosses on one of its row boundaries,
    or (None, shard size to try next) if `shard_numel` cannot hold them."""
    S = shard_numel
    offsets, cursor = [], 0
    for numel, q in zip(numels, rows):
        off = cursor
        boundary = (off // S + 1) * S              # first boundary strictly after the start
        if off + numel > boundary:
            off += (boundary - off) % q            # pad in front so the cut falls between rows
            if off + numel > boundary + S and S % q:
                return None, math.ceil(S / q) * q  # spans two boundaries: S must be whole rows
        offsets.append(off)
        cursor = off + numel
    if cursor > S * world_size:
        return None, S + max(1, math.ceil((cursor - S * world_size) / world_size))
    return offsets, S


def _local_view(slot: ParamSlot, flat: torch.Tensor) -> torch.Tensor:
    """`flat` (some whole rows of `slot`'s parameter) shaped (rows, *rest); 0-d stays 0-d."""
    if len(slot.shape) == 0:
        return flat.view(()) if flat.numel() else flat
    return flat.view(flat.numel() // slot.row_numel, *slot.shape[1:])


class FlatLayout:
    """Parameters laid end to end with row-aligned shard boundaries (see the module docstring)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[torch.Size], param_indices: Sequence[int],
                 world_size: int, padded_numel: Optional[int] = None, offsets: Optional[Sequence[int]] = None):
        if world_size < 1:
            raise ValueError(f"FlatLayout: world_size must be >= 1, got {world_size}")
        if not (len(names) == len(shapes) == len(param_indices)) or not names:
            raise ValueError(f"FlatLayout: expected equal, non-empty names/shapes/param_indices, got "
                             f"{len(names)}/{len(shapes)}/{len(param_indices)}")
        shapes = [torch.Size(s) for s in shapes]
        numels = [s.numel() for s in shapes]
        self.world_size = world_size
        self.numel = sum(numels)                                      # without padding
        if offsets is None:
            shard = max(1, math.ceil(self.numel / world_size))        # >= 1 element per rank
            while True:
                offsets, shard = _place(numels, [_row_numel(s) for s in shapes], shard, world_size)
                if offsets is not None:
                    break
            minimum = shard * world_size
        else:
            # An explicit placement (a checkpoint's): parameters in order, not overlapping.
            offsets = [int(o) for o in offsets]
            ends = [o + n for o, n in zip(offsets, numels)]
            if len(offsets) != len(numels) or any(o < e for o, e in zip(offsets[1:], ends)) or offsets[0] < 0:
                raise ValueError(f"FlatLayout: offsets {offsets} do not place {numels} elements in order")
            minimum = max(1, math.ceil(ends[-1] / world_size)) * world_size
        if padded_numel is None:
            padded_numel = minimum
        if padded_numel < minimum or padded_numel % world_size:
            raise ValueError(f"FlatLayout: padded_numel={padded_numel} must be a multiple of world_size "
                             f"({world_size}) and >= {minimum}")
        self.slots: List[ParamSlot] = [ParamSlot(n, s, o, s.numel(), int(i))
                                       for n, s, o, i in zip(names, shapes, offsets, param_indices)]
        self.padded_numel = padded_numel
        self.shard_numel = padded_numel // world_size

    @property
    def split_sizes(self) -> List[int]:
        """Sizes that cut the padded flat buffer into [gap, p0, gap, p1, ..., gap]: the
        parameters sit at odd positions (split_sizes[2 * i + 1] is slot i)."""
        sizes, cursor = [], 0
        for s in self.slots:
            sizes += [s.offset - cursor, s.numel]
            cursor = s.offset + s.numel
        return sizes + [self.padded_numel - cursor]

    def shard_range(self, rank: int) -> range:
        return range(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def shard_pieces(self, rank: int) -> List[ShardPiece]:
        """Intersections of `rank`'s shard with each parameter (parameters it misses are left out)."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        pieces = []
        for i, s in enumerate(self.slots):
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start < end:
                pieces.append(ShardPiece(i, start - s.offset, start - lo, end - start))
        return pieces

    def local_views(self, rank: int, shard: torch.Tensor) -> List[torch.Tensor]:
        """One view of `shard` (shard_numel,) per slot: `rank`'s rows of that parameter, shaped
        (local_rows, *rest); (0, *rest) where the rank holds none of it. A 0-d parameter is 0-d
        on the rank that holds it and an empty 1-d tensor elsewhere."""
        held = {p.slot_idx: p for p in self.shard_pieces(rank)}
        views = []
        for i, s in enumerate(self.slots):
            p = held.get(i)
            start, numel = (p.shard_start, p.numel) if p is not None else (0, 0)
            views.append(_local_view(s, shard[start: start + numel]))
        return views

    def local_part(self, rank: int, slot_idx: int, full: torch.Tensor) -> torch.Tensor:
        """`rank`'s rows of the full parameter-shaped tensor `full` of slot `slot_idx` (a view,
        shaped as local_views gives it)."""
        piece = next((p for p in self.shard_pieces(rank) if p.slot_idx == slot_idx), None)
        start, numel = (piece.param_start, piece.numel) if piece is not None else (0, 0)
        return _local_view(self.slots[slot_idx], full.reshape(-1)[start: start + numel])

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """`flat` (padded_numel,) cut into parameter-shaped views (no copy)."""
        return [flat[s.offset: s.offset + s.numel].view(s.shape) for s in self.slots]

    def shard_from_params(self, rank: int, params: Sequence[Optional[torch.Tensor]], out: torch.Tensor) -> None:
        """Fill `out` (shard_numel,) with `rank`'s slice of `params` (full tensors, one per slot;
        None counts as zero). Padding is zero."""
        out.zero_()
        for piece in self.shard_pieces(rank):
            src = params[piece.slot_idx]
            if src is not None:
                out[piece.shard_start: piece.shard_start + piece.numel].copy_(
                    src.reshape(-1)[piece.param_start: piece.param_start + piece.numel])

    def metadata(self) -> dict:
        """What a checkpoint records to check or rebuild this layout."""
        return {"names": [s.name for s in self.slots], "shapes": [list(s.shape) for s in self.slots],
                "param_indices": [s.param_index for s in self.slots], "world_size": self.world_size,
                "padded_numel": self.padded_numel, "offsets": [s.offset for s in self.slots]}

    @classmethod
    def from_metadata(cls, meta: dict) -> "FlatLayout":
        # Checkpoints written before row alignment have no "offsets": parameters end to end.
        offsets = meta.get("offsets")
        if offsets is None:
            offsets = [0]
            for shape in meta["shapes"][:-1]:
                offsets.append(offsets[-1] + torch.Size(shape).numel())
        return cls(meta["names"], [torch.Size(s) for s in meta["shapes"]], meta["param_indices"],
                   meta["world_size"], meta["padded_numel"], offsets)

    def __eq__(self, other):
        return isinstance(other, FlatLayout) and self.metadata() == other.metadata()

    def __repr__(self):
        return (f"FlatLayout({len(self.slots)} params, numel={self.numel}, padded={self.padded_numel}, "
                f"world_size={self.world_size}, shard={self.shard_numel})")
