"""torch.distributed's group helpers beyond new_group: new_subgroups, new_subgroups_by_enumeration,
split_group, get_global_rank / get_group_rank, with torch's semantics, built on groups.new_group and
Backend.split so that they work on both backends.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch.distributed as tdist

from .nodes import NodeLayout, node_ids
from .groups import (ProcessGroup, _check_ranks, _register, _timeout_seconds, get_default_group,
                     new_group, resolve_group)
from .membership import NON_GROUP_MEMBER


def get_global_rank(group, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank` (torch: ValueError if it is not in the group)."""
    g = resolve_group(group)
    if not isinstance(group_rank, int) or not 0 <= group_rank < g.world_size:
        raise ValueError(f"get_global_rank: group rank {group_rank!r} is not part of group '{g.name}' "
                         f"({g.world_size} ranks)")
    return g.ranks[group_rank]


def get_group_rank(group, global_rank: int) -> int:
    """`global_rank`'s rank in `group` (torch: ValueError if it is not in the group)."""
    return resolve_group(group).to_group_rank(global_rank, "global_rank")


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]], timeout=None, backend=None,
                                 pg_options=None, group_desc: Optional[str] = None
                                 ) -> Tuple[Optional[ProcessGroup], List[ProcessGroup]]:
    """One group per list of global ranks (disjoint); returns (this rank's group or None, all of
    them: NON_GROUP_MEMBER for those this rank is not in). Collective over the default group, as
    torch's."""
    if not ranks_per_subgroup_list:
        raise ValueError("new_subgroups_by_enumeration: ranks_per_subgroup_list must not be empty")
    seen = {}
    for ranks in ranks_per_subgroup_list:
        for r in ranks:
            if r in seen:
                raise ValueError(f"new_subgroups_by_enumeration: rank {r} is in more than one subgroup")
            seen[r] = True
    me = get_default_group().group_rank
    mine, subgroups = None, []
    for ranks in ranks_per_subgroup_list:
        g = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc)
        subgroups.append(g)
        if me in ranks:
            mine = g
    return mine, subgroups


def new_subgroups(group_size: Optional[int] = None, group=None, timeout=None, backend=None, pg_options=None,
                  group_desc: Optional[str] = None) -> Tuple[ProcessGroup, List[ProcessGroup]]:
    """Split the default group (or `group`, whose size it must divide) into consecutive blocks of
    `group_size` ranks. Returns (this rank's block, every block).

    group_size=None: one subgroup per node, as launched (torchrun's GROUP_RANK/LOCAL_WORLD_SIZE;
    comm/nodes.py). torch takes the CUDA device count, which is the same under torchrun with
    one process per GPU, and is undefined on CPU or with fewer processes than GPUs per node."""
    parent = get_default_group() if group is None else resolve_group(group)
    if pg_options is not None:
        raise NotImplementedError("new_subgroups: pg_options is not supported; subgroups inherit the parent's "
                                  "communicator configuration")
    if group_size is None:
        # NOTE: collective over the parent only (a subgroup's members call this, the others may not).
        blocks = NodeLayout.from_ids(node_ids(parent)).nodes      # group ranks per node
        blocks = [[parent.ranks[i] for i in block] for block in blocks]
    else:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ValueError(f"new_subgroups: group_size must be a positive int, got {group_size!r}")
        if group_size > parent.world_size or parent.world_size % group_size:
            raise ValueError(f"new_subgroups: group_size {group_size} must divide the group's size "
                             f"{parent.world_size}")
        blocks = [parent.ranks[i: i + group_size] for i in range(0, parent.world_size, group_size)]
    subgroups = _split(parent, blocks, timeout, backend, group_desc, "new_subgroups")
    # As torch's: the blocks this rank is not in are NON_GROUP_MEMBER in the list.
    return next(g for g in subgroups if g.is_member), [g if g.is_member else NON_GROUP_MEMBER for g in subgroups]


def split_group(parent_pg=None, split_ranks: Optional[Sequence[Sequence[int]]] = None, timeout=None,
                pg_options=None, group_desc: Optional[str] = None, backend=None):
    """torch.distributed.split_group: collective over `parent_pg` (default: the default group);
    `split_ranks` are disjoint lists of global ranks of the parent. Returns this rank's subgroup,
    or torch's GroupMember.NON_GROUP_MEMBER if it is in none. One Backend.split per list
    (ncclCommSplit on nccl). torch's is NCCL-only; here gloo works too, for a parent that spans
    the default group."""
    if not split_ranks:
        raise ValueError("split_group: split_ranks cannot be None or empty")
    if pg_options is not None:
        raise NotImplementedError("split_group: pg_options is not supported; pynccl subgroups inherit the "
                                  "parent communicator's configuration")
    parent = get_default_group() if parent_pg is None else resolve_group(parent_pg)
    mine = [g for g in _split(parent, split_ranks, timeout, backend, group_desc, "split_group") if g.is_member]
    return mine[0] if mine else tdist.GroupMember.NON_GROUP_MEMBER


def _split(parent: ProcessGroup, split_ranks, timeout, backend, group_desc, fn: str) -> List[ProcessGroup]:
    """One subgroup of `parent` per list of global ranks (disjoint): collective over the parent."""
    world = get_default_group()
    if backend is not None and str(backend) != parent.backend_name:
        raise ValueError(f"{fn}: backend {backend!r} differs from the parent's {parent.backend_name!r}")
    if not parent.is_member:
        raise ValueError(f"{fn}: global rank {world.group_rank} is not part of the parent group '{parent.name}'")
    if parent.backend_name == "gloo" and parent.world_size != world.world_size:
        # NOTE: a gloo split is torch.distributed.new_group, collective over the whole default group.
        raise NotImplementedError(f"{fn}: on gloo the parent must span the default group; use "
                                  "pynccl.new_group(ranks) on every rank instead")
    timeout_s = _timeout_seconds(timeout) if timeout is not None else parent.timeout_s
    lists = [_check_ranks(fn, ranks, world.world_size) for ranks in split_ranks]
    seen = set()
    for ranks in lists:
        outside = [r for r in ranks if r not in parent.ranks]
        if outside:
            raise ValueError(f"{fn}: ranks {outside} are not in the parent group '{parent.name}' "
                             f"(global ranks {parent.ranks})")
        if seen & set(ranks):
            raise ValueError(f"{fn}: rank(s) {sorted(seen & set(ranks))} appear in more than one split")
        seen |= set(ranks)
    out = []
    for ranks in lists:
        # NOTE: every parent rank runs every split (collective over the parent), in the same order, so
        # the per-parent count names the group alike on all of them (the global count would not: only
        # the parent's ranks are here).
        parent._num_splits = getattr(parent, "_num_splits", 0) + 1
        name = f"{parent.name}.split{parent._num_splits}" + (f"[{group_desc}]" if group_desc else "")
        local = [parent.to_group_rank(r) for r in ranks]
        out.append(_register(parent.backend.split(local, timeout_s, name), ranks, name, timeout_s,
                             parent.backend_name))
    return out
