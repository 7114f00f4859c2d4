"""ParallelMesh: one grid of ranks for data × tensor × pipeline parallelism, and every group of
every axis built from it. It is passed explicitly to the layers and wrappers that need it.

Rank layout (Megatron's order): tp varies fastest, then dp, then pp,
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank,
so a TP group is `tp` consecutive ranks (one NVLink island on a node) and pipeline
neighbours are dp*tp ranks apart. For hybrid sharding the dp axis is itself a grid,
dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank (torchtitan's
["pp", "dp_replicate", "dp_shard", "tp"]): a ZeRO shard group is dp_shard neighbouring dp
ranks, ideally the rest of a node after TP, and the replicas lie across nodes.

The mesh knows the node layout the job was launched with (comm/nodes.py: torchrun's GROUP_RANK and
LOCAL_WORLD_SIZE) and warns when a layout sends tensor parallelism, which exchanges activations in
every layer, over the network between nodes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from .comm import distributed as dist
from .comm.nodes import NodeLayout, node_layout


# Which mesh axis a model dimension is split along (check_divides); every other name: tp.
DIVIDED_BY = {"num_layers": "pp", "batch_size": "dp"}


@dataclass(frozen=True)
class MeshShape:
    dp: int
    tp: int
    pp: int
    dp_shard: Optional[int] = None     # ZeRO's shard group size within dp (None: all of dp)

    @property
    def shard(self) -> int:
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def replicate(self) -> int:
        return self.dp // self.shard

    def validate(self, world_size: int) -> None:
        for axis in ("dp", "tp", "pp", "dp_shard"):
            value = getattr(self, axis)
            if axis == "dp_shard" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelMesh: {axis} must be a positive int, got {value!r} ({self._text()})")
        if self.dp * self.tp * self.pp != world_size:
            raise ValueError(f"ParallelMesh: dp({self.dp}) × tp({self.tp}) × pp({self.pp}) = "
                             f"{self.dp * self.tp * self.pp}, but the world size is {world_size}")
        if self.dp % self.shard:
            raise ValueError(f"ParallelMesh: dp_shard={self.shard} must divide dp={self.dp} (dp = dp_replicate × "
                             f"dp_shard)")

    def _text(self) -> str:
        hybrid = "" if self.dp_shard is None else f", dp_shard={self.dp_shard}"
        return f"dp={self.dp}, tp={self.tp}, pp={self.pp}{hybrid}"

    @staticmethod
    def infer(world_size: int, dp: Optional[int], tp: int, pp: int, dp_shard: Optional[int] = None) -> "MeshShape":
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
        shape = MeshShape(dp, tp, pp, dp_shard)
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
            raise ValueError(f"ParallelMesh: {'; '.join(failures)} ({self._text()})")

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

    def groups(self, axis: str) -> List[List[int]]:
        """Every group of `axis` (tp, dp, pp, mp, dp_shard, dp_replicate), in the one order all
        ranks create them: each a list of global ranks in group-rank order."""
        S, R = self.shard, self.replicate
        lines = {
            "tp": lambda: [self.tp_ranks(d, p) for p in range(self.pp) for d in range(self.dp)],
            "dp": lambda: [self.dp_ranks(t, p) for p in range(self.pp) for t in range(self.tp)],
            "pp": lambda: [self.pp_ranks(d, t) for d in range(self.dp) for t in range(self.tp)],
            # all ranks holding one model replica (for norms over TP and PP shards)
            "mp": lambda: [[self.rank_of(d, t, p) for p in range(self.pp) for t in range(self.tp)]
                           for d in range(self.dp)],
            "dp_shard": lambda: [[self.rank_of(r * S + s, t, p) for s in range(S)]
                                 for p in range(self.pp) for t in range(self.tp) for r in range(R)],
            "dp_replicate": lambda: [[self.rank_of(r * S + s, t, p) for r in range(R)]
                                     for p in range(self.pp) for t in range(self.tp) for s in range(S)],
        }
        if axis not in lines:
            raise ValueError(f"MeshShape.groups: axis must be one of {', '.join(lines)}, got {axis!r}")
        return lines[axis]()

    def node_warnings(self, layout: NodeLayout) -> List[str]:
        """What this layout sends between nodes that should stay on one: tensor parallelism
        exchanges activations in every layer, which a network link cannot keep up with."""
        crossing = [g for g in self.groups("tp") if layout.spans_nodes(g)]
        if not crossing or self.tp == 1:
            return []
        per = layout.ranks_per_node
        advice = (f"use tp ≤ {per} dividing {per} (the ranks per node)" if per else "keep each TP group on one node")
        return [f"ParallelMesh({self._text()}): {len(crossing)} of {len(self.groups('tp'))} tensor-parallel groups "
                f"span nodes, e.g. ranks {crossing[0]} on nodes {layout.nodes_of(crossing[0])} ({layout}); "
                f"TP exchanges activations in every layer and needs one node's NVLink: {advice}"]


class ParallelMesh:
    """Groups for each axis; this rank's coordinates and pipeline neighbours.

    Collective: every rank of the default group constructs it with the same degrees.
    Groups: tp_group, dp_group, pp_group (this rank's line along each axis), mp_group (the
    tp × pp ranks that together hold one model replica) and world_group (every rank).

    dp_shard (hybrid sharding): ZeRO's shard group is dp_shard consecutive dp ranks and the
    replicas lie along dp_replicate = dp / dp_shard; "node" takes the rest of a node after TP
    (ranks per node / tp). dp_shard_group is then the shard group, dp_replicate_group the
    replicas (None where dp_shard = dp: nothing is replicated); pass the mesh to
    FullyShardedDataParallel(mesh=...). `nodes` is the node layout (comm/nodes.py).
    """

    def __init__(self, dp: Optional[int] = 1, tp: int = 1, pp: int = 1, timeout=None,
                 dp_shard: Union[None, int, str] = None):
        world_size = dist.get_world_size()
        self.nodes = node_layout()                     # NOTE: collective on first use
        if dp_shard == "node":
            dp_shard = self._shard_per_node(tp)
        # dp=None: whatever is left of the world once tp and pp are taken (dp = world / (tp × pp)).
        self.shape = MeshShape.infer(world_size, dp, tp, pp, dp_shard)
        for message in self.shape.node_warnings(self.nodes):
            warnings.warn(message, stacklevel=2)
        dp = self.shape.dp
        self.rank = dist.get_rank()
        self.world_size = world_size
        self.dp_size, self.tp_size, self.pp_size = dp, tp, pp
        self.dp_rank, self.tp_rank, self.pp_rank = self.shape.coords(self.rank)
        self.dp_shard_size, self.dp_replicate_size = self.shape.shard, self.shape.replicate
        self.dp_replicate_rank, self.dp_shard_rank = divmod(self.dp_rank, self.dp_shard_size)

        # NOTE: new_group is collective over the whole world, so every rank creates every
        # group of every axis in the same order, and keeps the one it belongs to.
        self.tp_group = self._axis_groups(self.shape.groups("tp"), timeout)
        self.dp_group = self._axis_groups(self.shape.groups("dp"), timeout)
        self.pp_group = self._axis_groups(self.shape.groups("pp"), timeout)
        self.mp_group = self._axis_groups(self.shape.groups("mp"), timeout)
        self.world_group = dist.get_default_group()
        hybrid = self.dp_replicate_size > 1
        self.dp_shard_group = self._axis_groups(self.shape.groups("dp_shard"), timeout) if hybrid else self.dp_group
        self.dp_replicate_group = self._axis_groups(self.shape.groups("dp_replicate"), timeout) if hybrid else None

    def _shard_per_node(self, tp: int) -> int:
        per = self.nodes.ranks_per_node
        if per is None or per % tp:
            raise ValueError(f"ParallelMesh: dp_shard='node' needs equal nodes whose size divides by tp={tp}; "
                             f"the job has {self.nodes}")
        return per // tp

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
        hybrid = (f" (dp_replicate_rank {self.dp_replicate_rank}, dp_shard_rank {self.dp_shard_rank})"
                  if self.dp_replicate_group is not None else "")
        return (f"ParallelMesh({self.shape._text()}; rank {self.rank} = dp_rank {self.dp_rank}{hybrid}, "
                f"tp_rank {self.tp_rank}, pp_rank {self.pp_rank})")
