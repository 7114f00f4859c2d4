"""Which ranks share a machine: the node layout a job was launched with.

torchrun starts one agent per node; each gives its workers GROUP_RANK (the node's index in the
job) and LOCAL_WORLD_SIZE (how many workers it runs), and global ranks go to nodes in blocks, node
by node. Parallel layouts use this to keep the chattiest groups (tensor parallelism, ZeRO's shard
group) on one node's NVLink and send only data parallelism over the network.

NodeLayout is pure arithmetic, unit-tested without processes. node_layout() asks every rank for
its node once (a collective over the default group), so a layout nobody planned for (nodes of
different sizes, ranks out of node order, a launcher other than torchrun) is seen as it is.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple


def node_id_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """This process's node: torchrun's GROUP_RANK; else the block of LOCAL_WORLD_SIZE ranks its RANK
    falls in (launchers that set only the LOCAL_* variables); else the host name."""
    if environ.get("GROUP_RANK") not in (None, ""):
        return f"node{int(environ['GROUP_RANK'])}"
    local_world, rank = environ.get("LOCAL_WORLD_SIZE"), environ.get("RANK")
    if local_world not in (None, "") and rank not in (None, ""):
        return f"node{int(rank) // int(local_world)}"
    return f"host:{socket.gethostname()}"


@dataclass(frozen=True)
class NodeLayout:
    """node_of[r] is the node (0, 1, ... in order of each node's lowest rank) global rank r runs on."""

    node_of: Tuple[int, ...]

    @classmethod
    def from_ids(cls, ids: Sequence[object]) -> "NodeLayout":
        """From any per-rank node identifiers (GROUP_RANKs, host names), numbered by first appearance."""
        index: Dict[object, int] = {}
        return cls(tuple(index.setdefault(i, len(index)) for i in ids))

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int) -> "NodeLayout":
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"NodeLayout.uniform: {ranks_per_node} ranks per node do not divide the world size "
                             f"{world_size}")
        return cls(tuple(r // ranks_per_node for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1 if self.node_of else 0

    def ranks(self, node: int) -> List[int]:
        """The global ranks on `node`, ascending."""
        return [r for r, n in enumerate(self.node_of) if n == node]

    @property
    def nodes(self) -> List[List[int]]:
        return [self.ranks(n) for n in range(self.num_nodes)]

    @property
    def ranks_per_node(self) -> Optional[int]:
        """The number of ranks on every node, or None where nodes differ."""
        sizes = {len(r) for r in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def is_blocked(self) -> bool:
        """Every node holds consecutive ranks (torchrun's assignment)."""
        return all(r == list(range(r[0], r[0] + len(r))) for r in self.nodes)

    def local_rank(self, rank: int) -> int:
        return self.ranks(self.node_of[rank]).index(rank)

    def nodes_of(self, ranks: Sequence[int]) -> List[int]:
        """The nodes a group of ranks touches, ascending."""
        return sorted({self.node_of[r] for r in ranks})

    def spans_nodes(self, ranks: Sequence[int]) -> bool:
        return len(self.nodes_of(ranks)) > 1

    def inter_node_groups(self) -> List[List[int]]:
        """One group per local index: the i-th rank of every node (the lines data parallelism
        runs along when each node holds one replica's shards). Needs equal nodes."""
        if self.ranks_per_node is None:
            raise ValueError(f"inter_node_groups: the nodes hold different numbers of ranks ({self})")
        return [list(group) for group in zip(*self.nodes)]

    def __str__(self) -> str:
        per = self.ranks_per_node
        shape = f"{self.num_nodes} node(s) × {per} rank(s)" if per else f"{self.num_nodes} nodes of unequal size"
        return shape + ": " + ", ".join(f"node {n} = ranks {_spans(r)}" for n, r in enumerate(self.nodes))


def _spans(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}-{r}")
            start = None
    return ",".join(parts)


def node_ids(group) -> List[str]:
    """node_id_from_env() of each rank of `group`, in group order (collective over the group)."""
    from .object_collectives import all_gather_object
    ids = [None] * group.world_size
    all_gather_object(ids, node_id_from_env(), group=group)
    return ids


def node_layout() -> NodeLayout:
    """The job's node layout, gathered once per default group (collective over it the first
    time: every rank must call it then; later calls return the same object)."""
    from .groups import get_default_group
    world = get_default_group()
    layout = getattr(world, "_pynccl_node_layout", None)
    if layout is None:
        layout = NodeLayout.from_ids(node_ids(world))
        world._pynccl_node_layout = layout
    return layout
