"""torch's rules for who takes part in an op: GroupMember.NON_GROUP_MEMBER (what new_group and
split_group return on a rank outside the group) and the root of a rooted op given either as a
global rank (src / dst / peer) or as a rank of the group (group_src / group_dst / group_peer).

One place, so every function of pynccl.comm.distributed treats them as torch 2.11 does:
  * a collective, rooted or not, on NON_GROUP_MEMBER warns (torch's words) and returns None
    (recv returns -1); get_rank / get_world_size give -1. NOTE: torch maps a global root on
    NON_GROUP_MEMBER through its registry of groups, where -100 stands for the non-member group
    made last, so it raises when the root is not in that group and skips otherwise; pynccl
    skips always (the case torch users meet: the group just made, its own root).
  * the blocking send and send_object_list / recv_object_list raise on NON_GROUP_MEMBER (torch
    raises there too, an AttributeError from group.rank() on the int);
  * exactly one of a global rank and a group rank names a root (torch's _canonicalize_group_rank).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch.distributed as tdist

NON_GROUP_MEMBER = tdist.GroupMember.NON_GROUP_MEMBER


def is_non_member(group) -> bool:
    """Whether `group` is torch's GroupMember.NON_GROUP_MEMBER (an int, -100)."""
    return type(group) is int and group == NON_GROUP_MEMBER


def warn_not_in_group(op_name: str) -> None:
    """torch's _warn_not_in_group, word for word, so filters written for torch's warning match."""
    from .process_group import _state
    rank = _state.world.group_rank if _state.initialized else -1
    warnings.warn(f"Running {op_name} on global rank {rank} which does not belong to the given group.",
                  stacklevel=3)


def non_member_error(fn: str) -> ValueError:
    return ValueError(f"{fn}: group is GroupMember.NON_GROUP_MEMBER (this rank is not in the group), so a "
                      f"global rank cannot be mapped to a rank of it (torch raises ValueError here too); "
                      f"skip the call on ranks outside the group")


def root_rank(g, fn: str, global_rank: Optional[int], group_rank: Optional[int], what: str) -> int:
    """The group rank of an op's root/peer given as `what` (a global rank) or `group_<what>` (a rank
    of `g`): exactly one of them, as torch's _canonicalize_group_rank."""
    from .process_group import _require_usable
    _require_usable(g)   # not initialized / destroyed: the group's own error first
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError(f"{fn}: pass {what}= (a global rank) or group_{what}= (a rank of the group), not both "
                             f"(got {what}={global_rank}, group_{what}={group_rank})")
        if not isinstance(group_rank, int) or isinstance(group_rank, bool) or not 0 <= group_rank < g.world_size:
            raise ValueError(f"{fn}: group_{what}={group_rank!r} is not a rank of group '{g.name}' "
                             f"(ranks 0..{g.world_size - 1})")
        return group_rank
    if global_rank is None:
        raise ValueError(f"{fn}: {what}= (a global rank) or group_{what}= (a rank of the group) is required")
    return g.to_group_rank(global_rank, what)
