"""ParallelMesh: one grid of ranks for data × tensor × pipeline parallelism, and every group of
every axis built from it. It is passed explicitly to the layers and wrappers that need it.

Rank layout (Megatron's order): tp varies fastest, then dp, then pp,
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank,
so a TP group is `tp` consecutive ranks (one NVLink island on a node) and pipeline
neighbours are dp*tp ranks apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .comm import distributed as dist


# Which mesh axis a model dimension is split along (check_divides); every other name: tp.
DIVIDED_BY = {"num_layers": "pp", "batch_size": "dp"}


@dataclass(frozen=True)
class MeshShape:
    dp: int
    tp: int
    pp: int

    def validate(self, world_size: int) -> None:
        for axis in ("dp", "tp", "pp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelMesh: {axis} must be a positive int, got {value!r} "
                                 f"(dp={self.dp}, tp={self.tp}, pp={self.pp})")
        if self.dp * self.tp * self.pp != world_size:
            raise ValueError(f"ParallelMesh: dp({self.dp}) × tp({self.tp}) × pp({self.pp}) = "
                             f"{self.dp * self.tp * self.pp}, but the world size is {world_size}")

    @staticmethod
    def infer(world_size: int, dp: Optional[int], tp: int, pp: int) -> "MeshShape":
        """The shape with dp = world_size / (tp × pp) when dp is None (the usual default)."""
        for axis, value in (("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelMesh: {axis} must be a positive int, got {value!r} "
                                 f"(dp={dp}, tp={tp}, pp={pp}, world size {world_size})")
        if dp is None:
            if world_size % (tp * pp):
                raise ValueError(f"ParallelMesh: the world size {world_size} is not divisible by tp({tp}) × "
                                 f"pp({pp}) = {tp * pp}, so dp = world / (tp × pp) is not an integer")
            dp = world_size // (tp * pp)
        shape = MeshShape(dp, tp, pp)
        shape.validate(world_size)
        return shape

    def check_divides(self, **dims: int) -> None:
        """Raise one ValueError naming every model dimension that does not divide by its degree:
        num_layers by pp, batch_size (the global batch) by dp, every other name by tp
        (num_heads, hidden_size, vocab_size, seq_len under sequence parallelism, ...)."""
        failures = []
        for name, value in dims.items():
            axis = DIVIDED_BY.get(name, "tp")
            degree = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                failures.append(f"{name} must be a positive int, got {value!r}")
            elif value % degree:
                failures.append(f"{name}={value} is not divisible by {axis}={degree}")
        if failures:
            raise ValueError(f"ParallelMesh: {'; '.join(failures)} (dp={self.dp}, tp={self.tp}, pp={self.pp})")

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(dp_rank, tp_rank, pp_rank) of a global rank."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return dp_rank, tp_rank, pp_rank

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def dp_ranks(self, tp_rank: int, pp_rank: int):
        return [self.rank_of(d, tp_rank, pp_rank) for d in range(self.dp)]

    def tp_ranks(self, dp_rank: int, pp_rank: int):
        return [self.rank_of(dp_rank, t, pp_rank) for t in range(self.tp)]

    def pp_ranks(self, dp_rank: int, tp_rank: int):
        return [self.rank_of(dp_rank, tp_rank, p) for p in range(self.pp)]


class ParallelMesh:
    """Groups for each axis; this rank's coordinates and pipeline neighbours.

    Collective: every rank of the default group constructs it with the same degrees.
    Groups: tp_group, dp_group, pp_group (this rank's line along each axis), mp_group (the
    tp × pp ranks that together hold one model replica) and world_group (every rank).
    """

    def __init__(self, dp: Optional[int] = 1, tp: int = 1, pp: int = 1, timeout=None):
        world_size = dist.get_world_size()
        # dp=None: whatever is left of the world once tp and pp are taken (dp = world / (tp × pp)).
        self.shape = MeshShape.infer(world_size, dp, tp, pp)
        dp = self.shape.dp
        self.rank = dist.get_rank()
        self.world_size = world_size
        self.dp_size, self.tp_size, self.pp_size = dp, tp, pp
        self.dp_rank, self.tp_rank, self.pp_rank = self.shape.coords(self.rank)

        # NOTE: new_group is collective over the whole world, so every rank creates every
        # group of every axis in the same order, and keeps the one it belongs to.
        self.tp_group = self._axis_groups(
            [self.shape.tp_ranks(d, p) for p in range(pp) for d in range(dp)], timeout)
        self.dp_group = self._axis_groups(
            [self.shape.dp_ranks(t, p) for p in range(pp) for t in range(tp)], timeout)
        self.pp_group = self._axis_groups(
            [self.shape.pp_ranks(d, t) for d in range(dp) for t in range(tp)], timeout)
        # Model-parallel group (all ranks holding one replica): for norms over TP and PP shards.
        self.mp_group = self._axis_groups(
            [[self.shape.rank_of(d, t, p) for p in range(pp) for t in range(tp)] for d in range(dp)], timeout)
        self.world_group = dist.get_default_group()

    def _axis_groups(self, all_ranks, timeout):
        mine = None
        for ranks in all_ranks:
            group = dist.new_group(ranks, timeout=timeout)
            if self.rank in ranks:
                mine = group
        return mine

    # --- pipeline neighbours (global ranks; None at the ends) ---------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_next_rank(self) -> Optional[int]:
        return None if self.is_last_stage else self.shape.rank_of(self.dp_rank, self.tp_rank, self.pp_rank + 1)

    @property
    def pp_prev_rank(self) -> Optional[int]:
        return None if self.is_first_stage else self.shape.rank_of(self.dp_rank, self.tp_rank, self.pp_rank - 1)

    def check_divides(self, **dims: int) -> None:
        """Raise one ValueError naming every dimension that does not divide by its degree and the
        mesh, e.g. mesh.check_divides(num_heads=12, hidden_size=768, num_layers=6, batch_size=32):
        num_layers by pp, batch_size by dp, every other name by tp (see MeshShape.check_divides)."""
        self.shape.check_divides(**dims)

    def __repr__(self):
        return (f"ParallelMesh(dp={self.dp_size}, tp={self.tp_size}, pp={self.pp_size}; rank {self.rank} = "
                f"dp_rank {self.dp_rank}, tp_rank {self.tp_rank}, pp_rank {self.pp_rank})")
