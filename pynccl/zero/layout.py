"""Flat shard layout: where each parameter of a unit sits in the unit's flat buffer, and which
equal-sized slice of that buffer each rank owns. Pure index arithmetic (no processes, no
data), so it is unit-tested directly; everything that moves data (gather, reduce-scatter,
checkpoints, resharding) reads positions from here and nowhere else.

    flat buffer (padded to a multiple of world_size, padding is zero):
    | p0 .......... | p1 ..... | p2 .................... | pad |
    | rank 0 shard       | rank 1 shard       | rank 2 shard       |
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


class ShardPiece(NamedTuple):
    """The part of parameter `slot_idx` that lies in one rank's shard."""

    slot_idx: int
    param_start: int          # element offset inside the (flattened) parameter
    shard_start: int          # element offset inside the shard
    numel: int


class FlatLayout:
    """Parameters laid end to end, padded so that world_size equal shards cover them."""

    def __init__(self, names: Sequence[str], shapes: Sequence[torch.Size], param_indices: Sequence[int],
                 world_size: int, padded_numel: Optional[int] = None):
        if world_size < 1:
            raise ValueError(f"FlatLayout: world_size must be >= 1, got {world_size}")
        if not (len(names) == len(shapes) == len(param_indices)) or not names:
            raise ValueError(f"FlatLayout: expected equal, non-empty names/shapes/param_indices, got "
                             f"{len(names)}/{len(shapes)}/{len(param_indices)}")
        self.slots: List[ParamSlot] = []
        offset = 0
        for name, shape, idx in zip(names, shapes, param_indices):
            shape = torch.Size(shape)
            self.slots.append(ParamSlot(name, shape, offset, shape.numel(), int(idx)))
            offset += shape.numel()
        self.world_size = world_size
        self.numel = offset                                           # unpadded
        minimum = max(1, math.ceil(offset / world_size)) * world_size  # >= 1 element per rank
        if padded_numel is None:
            padded_numel = minimum
        if padded_numel < minimum or padded_numel % world_size:
            raise ValueError(f"FlatLayout: padded_numel={padded_numel} must be a multiple of world_size "
                             f"({world_size}) and >= {minimum}")
        self.padded_numel = padded_numel
        self.shard_numel = padded_numel // world_size

    @property
    def split_sizes(self) -> List[int]:
        """Sizes that cut the padded flat buffer into the parameters plus the padding."""
        return [s.numel for s in self.slots] + [self.padded_numel - self.numel]

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
                "padded_numel": self.padded_numel}

    @classmethod
    def from_metadata(cls, meta: dict) -> "FlatLayout":
        return cls(meta["names"], [torch.Size(s) for s in meta["shapes"]], meta["param_indices"],
                   meta["world_size"], meta["padded_numel"])

    def __eq__(self, other):
        return isinstance(other, FlatLayout) and self.metadata() == other.metadata()

    def __repr__(self):
        return (f"FlatLayout({len(self.slots)} params, numel={self.numel}, padded={self.padded_numel}, "
                f"world_size={self.world_size}, shard={self.shard_numel})")
