"""What a process group is: ProcessGroup (a set of global ranks and the Backend that talks to them,
and its torch.distributed twin), and the state of one init that every other module of comm/
reads (the default group, the groups made since, the store). groups.py holds the life cycle that
changes it; torch_interop.py maps torch's groups onto it.
"""
from __future__ import annotations

import weakref
from typing import List, Sequence

import torch.distributed as tdist

from .members_only_groups import new_members_only_group

DEFAULT_TIMEOUT_S = 600.0


class _Unusable:
    """Stands in for a group's backend where no op may run; every use raises `error`."""

    __slots__ = ("_error",)

    def __init__(self, error: Exception):
        self._error = error

    def __getattr__(self, name):
        raise self._error


class GroupRank(int):
    """This process's rank in a group, as an int that may also be called: `g.rank()` is torch's
    ProcessGroup.rank(); `g.rank` used as an int is pynccl 0.1's attribute, so code written
    either way gets the same number (a plain method would make the old `g.rank == 0` silently
    False). New code reads `g.rank()` or `g.group_rank`."""

    __slots__ = ()

    def __call__(self) -> int:
        return int(self)


class ProcessGroup:
    """A set of global ranks and the Backend that talks to them.

    As torch's ProcessGroup: `rank()` / `size()` are this process's position in the group and
    the group's size (torch.distributed.get_rank(group) / get_world_size(group)). The same as
    plain ints: `group_rank` and `world_size`. `ranks` are the global ranks, in group order.
    """

    def __init__(self, backend, ranks: Sequence[int], name: str, timeout_s: float, backend_name: str):
        self.backend = backend
        self.ranks = list(ranks)
        self.name = name
        self.timeout_s = timeout_s
        self.backend_name = backend_name
        self._group_rank_of = {g: i for i, g in enumerate(self.ranks)}
        self.group_rank = -1 if isinstance(backend, _Unusable) else backend.rank
        self.world_size = len(self.ranks)
        self._torch_group = None   # the torch ProcessGroup of the same ranks (torch_interop.py)

    @property
    def rank(self) -> GroupRank:
        """torch's `g.rank()`; see GroupRank."""
        return GroupRank(self.group_rank)

    def size(self) -> int:
        """torch's ProcessGroup.size(): the number of ranks in the group."""
        return self.world_size

    @property
    def torch_group(self):
        """A torch.distributed ProcessGroup over the same global ranks, for torch APIs that need
        one: the torch group this group was mapped from (torch_interop.py); on gloo the torch gloo
        group the backend runs on; on nccl a "cpu:gloo,cuda:nccl" torch group made on first access
        by the members (use_local_synchronization, so the first access is collective over them),
        carrying CUDA and CPU tensors. Cached on the group."""
        _require_usable(self)
        if self._torch_group is not None:
            return self._torch_group
        pg = getattr(self.backend, "pg", None)   # gloo: the torch gloo group the backend runs on
        if pg is None:
            full = self.ranks == list(range(tdist.get_world_size()))
            if full and "nccl" in torch_backend_name(tdist.group.WORLD):
                pg = tdist.group.WORLD
            else:
                pg = new_members_only_group(self.ranks, "cpu:gloo,cuda:nccl", self.timeout_s, f"torch_group/{self.name}")
        self._torch_group = pg
        _state.torch_groups[pg] = self
        return pg

    @property
    def is_member(self) -> bool:
        return self.group_rank >= 0

    def to_group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Group rank of `global_rank`; ValueError naming the group if it is not in it."""
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{what} must be an int (a global rank), got {type(global_rank).__name__}")
        idx = self._group_rank_of.get(global_rank)
        if idx is None:
            raise ValueError(f"{what}={global_rank} is not a rank of group '{self.name}' "
                             f"(global ranks {self.ranks})")
        return idx

    def __repr__(self):
        return (f"ProcessGroup(name={self.name!r}, backend={self.backend_name!r}, ranks={self.ranks}, "
                f"rank={self.group_rank})")


class _State:
    def __init__(self):
        self.reset()

    def reset(self):
        self.world = ProcessGroup(
            _Unusable(RuntimeError("pynccl: the default process group is not initialized; "
                                   "call pynccl.init_process_group(backend='nccl'|'gloo') first")),
            [], "<uninitialized>", DEFAULT_TIMEOUT_S, "none")
        self.initialized = False
        self.groups: List[ProcessGroup] = []
        self.store = None
        self.owns_torch_dist = False
        self.num_groups_created = 0
        self.check_collectives = False
        self.key_prefix = "pynccl/0"   # store keys of this init: "pynccl/<generation>"
        # torch ProcessGroup -> the pynccl group of its ranks (torch_interop.py); weak, so a
        # torch group that is dropped is not kept alive by pynccl.
        self.torch_groups = weakref.WeakKeyDictionary()
        self.torch_group_uses = {}    # torch group name -> how many times it was mapped (store keys)


_state = _State()


def torch_backend_name(pg) -> str:
    """The backend string torch reports for torch group `pg` ("" where it reports none)."""
    try:
        return str(tdist.get_backend(pg))
    except (RuntimeError, ValueError):
        return ""


def _require_usable(g: ProcessGroup) -> ProcessGroup:
    """Raise the group's own error (not initialized / destroyed / not a member) if it has one."""
    if isinstance(g.backend, _Unusable):
        raise g.backend._error
    return g


def get_default_group() -> ProcessGroup:
    return _require_usable(_state.world)


def _maybe_checked(backend, name: str):
    """`backend`, behind the cross-rank signature check when this init asked for it."""
    if not _state.check_collectives:
        return backend
    from .collective_check import CheckedBackend
    return CheckedBackend(backend, _state.store, name, _state.key_prefix)
