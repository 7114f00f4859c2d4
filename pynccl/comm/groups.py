"""Process groups and their life cycle: the default group, init (rendezvous + backend),
new_group, destroy/abort, and resolve_group, where every `group=` argument is normalised.
What a group is and the state of an init (what every collective reads) are process_group.py.
"""
from __future__ import annotations

import atexit
import datetime
import os
import time
from typing import List, Optional, Sequence

import torch

from . import rendezvous
from .backend_names import parse_backend
from .membership import NON_GROUP_MEMBER, is_non_member
# NOTE: re-exported: every module of comm/ reads the group state and its helpers through here.
from .process_group import (DEFAULT_TIMEOUT_S, GroupRank, ProcessGroup, _maybe_checked, _require_usable,  # noqa: F401
                            _state, _Unusable, get_default_group)
from .torch_interop import from_torch_group


# ----------------------------------------------------------------------------- init/groups
def _timeout_seconds(timeout) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return float(timeout)


def _make_backend(backend: str, rank: int, world_size: int, timeout_s: float, device_id, store, prefix: str,
                  name: str, options):
    if backend == "gloo":
        from .backends.gloo import GlooBackend
        return GlooBackend.from_default_group(timeout_s)
    from .backends.nccl import NcclBackend
    device = rendezvous.resolve_cuda_device(device_id)
    unique_id = rendezvous.exchange_unique_id(store, prefix, rank, timeout_s)
    return NcclBackend.create(unique_id, world_size, rank, device, timeout_s, options=options, name=name)


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None, timeout=None,
                       world_size: int = -1, rank: int = -1, store=None, group_name: str = "", pg_options=None,
                       device_id=None, *, check_collectives: Optional[bool] = None) -> None:
    """Create the default group over all ranks. torch.distributed.init_process_group's arguments,
    in its positional order; check_collectives is pynccl's own (keyword only).

    backend: "nccl" (CUDA tensors, pynccl's communicator) or "gloo" (CPU tensors, torch's gloo);
    None picks "nccl" where CUDA and the extension are present, else "gloo"; torch's spellings
    are taken too (parse_backend: Backend.NCCL, "NCCL", "cpu:gloo,cuda:nccl").
    timeout: seconds or a datetime.timedelta (default 600 s).
    Reads the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
    unless rank/world_size/store are given. If torch.distributed is already initialised,
    its rank, world size and store are reused, so scripts that set it up keep working.
    Otherwise torch.distributed's default group is made on the same store, as torch's
    init_process_group(backend) would make it: "cpu:gloo,cuda:nccl" for "nccl" (torch code that
    follows, init_device_mesh("cuda", ...), DTensor, fully_shard, torch.distributed.all_reduce
    on CUDA or CPU tensors, just works; torch's NCCL communicator is made lazily, at torch's first
    CUDA collective, so init costs what it did) and "gloo" for "gloo". pynccl's own functions
    take the group's device only: CUDA tensors on "nccl", CPU tensors on "gloo".
    group_name: the default group's name in errors and flight records ("" -> "world").
    pg_options: for "nccl", a pynccl NcclOptions (or a dict of its fields); None for "gloo".
    check_collectives (default: PYNCCL_CHECK_COLLECTIVES=1): compare every collective's
    signature across ranks through the store first (see collective_check.py).
    """
    backend = parse_backend("init_process_group", backend)
    if pg_options is not None:
        from .backends.nccl import NcclOptions
        if backend != "nccl" or not isinstance(pg_options, (NcclOptions, dict)):
            raise TypeError(f"init_process_group: pg_options must be a pynccl NcclOptions (or a dict of its "
                            f"fields) with backend='nccl', got {type(pg_options).__name__} with backend={backend!r}")
    if _state.initialized:
        raise RuntimeError("init_process_group: the default process group is already initialized; "
                           "call pynccl.destroy_process_group() first")
    timeout_s = _timeout_seconds(timeout)
    if backend == "nccl":
        from .._ext import require_extension
        require_extension("backend='nccl'")
    rank, world_size, store, owns = rendezvous.bootstrap(init_method, rank, world_size, timeout_s, store,
                                                      torch_backend=rendezvous.torch_backend_for(backend))
    prefix = f"pynccl/{rendezvous.next_generation()}"
    name = group_name or "world"
    be = _make_backend(backend, rank, world_size, timeout_s, device_id, store, prefix, name, pg_options)
    _state.key_prefix = prefix
    _state.store = store
    if check_collectives is None:
        check_collectives = os.environ.get("PYNCCL_CHECK_COLLECTIVES", "0") == "1"
    _state.check_collectives = check_collectives
    _state.world = ProcessGroup(_maybe_checked(be, name), range(world_size), name, timeout_s, backend)
    _state.owns_torch_dist = owns
    _state.initialized = True
    _state.groups = [_state.world]


def flight_record(group=None) -> List[dict]:
    """The group's last collectives (oldest first): op, seq, dtype, count, peer, state,
    enqueue_time_us. Also written as JSON when an op of the group fails or times out."""
    return resolve_group(group).backend.flight_record()


def is_initialized() -> bool:
    return _state.initialized


def resolve_group(group) -> ProcessGroup:
    """The ProcessGroup `group` stands for: the default group for None; for a torch.distributed
    ProcessGroup, the pynccl group of the same global ranks (made on first use, then cached:
    torch_interop.py); for a 1-D torch DeviceMesh, its group. ValueError for
    GroupMember.NON_GROUP_MEMBER (the functions of pynccl.comm.distributed skip it first, as
    torch's do); TypeError for anything else. The one place every API that takes `group=` /
    `process_group=` normalises it (collectives, DDP, FSDP, TP, PipelineStage)."""
    if group is None:
        return _state.world
    if type(group) is ProcessGroup:
        return group
    if is_non_member(group):
        raise ValueError("group is GroupMember.NON_GROUP_MEMBER: this rank is not in that group (new_group / "
                         "split_group return it on ranks outside the group); call this only on its members")
    return from_torch_group(group)


def to_torch_group(group=None):
    """A torch.distributed ProcessGroup over the global ranks of pynccl group `group` (None: the
    default group), in the same order, for torch APIs that take one: `group.torch_group`
    (process_group.py; made on first access, which is collective over the group's members)."""
    return _require_usable(resolve_group(group)).torch_group


def get_store():
    """The rendezvous TCPStore (for side-channel checks); raises before init."""
    _require_usable(_state.world)
    return _state.store


def get_rank(group=None) -> int:
    """This process's rank in `group` (default: the default group); -1 for NON_GROUP_MEMBER."""
    if is_non_member(group):
        return -1
    g = resolve_group(group)
    return _require_usable(g).group_rank if g is _state.world else g.group_rank


def get_world_size(group=None) -> int:
    """The number of ranks of `group` (default: the default group); -1 for NON_GROUP_MEMBER."""
    if is_non_member(group):
        return -1
    g = resolve_group(group)
    return _require_usable(g).world_size if g is _state.world else g.world_size


def get_backend(group=None) -> str:
    return _require_usable(resolve_group(group)).backend_name


def get_device(group=None) -> torch.device:
    """The device this group's tensors must live on (cuda:N for nccl, cpu for gloo)."""
    return resolve_group(group).backend.device


def get_process_group_ranks(group) -> List[int]:
    """The global ranks of `group` (None: the default group), in group order."""
    return list(resolve_group(group).ranks)


def _check_ranks(fn: str, ranks, world_size: int) -> List[int]:
    ranks = list(ranks)
    if not ranks:
        raise ValueError(f"{fn}: ranks must not be empty")
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"{fn}: ranks must be ints (global ranks), got {r!r}")
        if not 0 <= r < world_size:
            raise ValueError(f"{fn}: rank {r!r} out of range [0, {world_size})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{fn}: ranks contain duplicates: {ranks}")
    return sorted(ranks)


def _next_group_name() -> str:
    _state.num_groups_created += 1
    return f"group{_state.num_groups_created}"


def _register(sub, ranks: List[int], name: str, timeout_s: float, backend_name: str,
              checked: bool = True) -> ProcessGroup:
    """The ProcessGroup around a split's result (`sub` None on a rank outside `ranks`); checked=False
    keeps it out of the cross-rank signature check (duplicate_group says when)."""
    if sub is None:
        sub = _Unusable(ValueError(f"rank {_state.world.group_rank} is not a member of group '{name}' "
                                   f"(global ranks {ranks})"))
    elif checked:
        sub = _maybe_checked(sub, name)
    group = ProcessGroup(sub, ranks, name, timeout_s, backend_name)
    _state.groups.append(group)
    return group


def new_group(ranks: Optional[Sequence[int]] = None, timeout=None, backend: Optional[str] = None,
              pg_options=None, use_local_synchronization: bool = False, group_desc: Optional[str] = None,
              device_id=None):
    """A group over the given global ranks. Collective over the default group: every rank
    calls it with the same `ranks`, members and non-members alike (as in torch). A rank outside
    `ranks` gets GroupMember.NON_GROUP_MEMBER, as from torch: collectives on it are skipped and
    get_rank / get_world_size give -1. torch's pg_options and use_local_synchronization=True are
    refused (a split is collective over the parent); group_desc names the group; device_id, if
    given, must be the default group's device (a pynccl group runs where the default one does)."""
    world = get_default_group()
    if backend is not None and parse_backend("new_group", backend) != world.backend_name:
        raise ValueError(f"new_group: backend {backend!r} differs from the default group's "
                         f"{world.backend_name!r}; pynccl groups share the default group's backend")
    if device_id is not None and torch.device(device_id) not in (world.backend.device,
                                                                 torch.device(world.backend.device.type)):
        raise ValueError(f"new_group: device_id {device_id} differs from the default group's device "
                         f"{world.backend.device}; pynccl groups run on the default group's device")
    if pg_options is not None or use_local_synchronization:
        raise NotImplementedError("new_group: pg_options and use_local_synchronization=True are not supported "
                                  "(ncclCommSplit is collective over the default group); to make a group only its "
                                  "members call, make it with torch.distributed.new_group(ranks, "
                                  "use_local_synchronization=True) and pass that: pynccl maps it on first use")
    ranks = list(range(world.world_size)) if ranks is None else _check_ranks("new_group", ranks, world.world_size)
    timeout_s = _timeout_seconds(timeout) if timeout is not None else world.timeout_s
    name = _next_group_name() + (f"[{group_desc}]" if group_desc else "")
    group = _register(world.backend.split(ranks, timeout_s, name), ranks, name, timeout_s, world.backend_name)
    return group if group.is_member else NON_GROUP_MEMBER


def duplicate_group(group, desc: str, checked: bool = True) -> ProcessGroup:
    """A second group over `group`'s ranks, with its own communicator: the collectives of the two
    are ordered independently. Made on the first call for (group, desc), collective over `group`'s
    members only, then cached on `group` (every later caller shares it); destroyed with the others.
    checked=False: never behind PYNCCL_CHECK_COLLECTIVES's signature check, for a group whose
    order is fixed by construction but whose timing is not (the check blocks the host until every
    rank reaches the collective; ZeRO-3's reduce-scatters, which a rank that skipped a block starts
    only at the end of its backward, would hang against the all-gathers on the other group)."""
    g = _require_usable(resolve_group(group))
    dups = g.__dict__.setdefault("_duplicates", {})
    if desc not in dups or dups[desc] not in _state.groups:
        name = f"{g.name}.dup[{desc}]"
        dups[desc] = _register(g.backend.duplicate(g.timeout_s, name), g.ranks, name, g.timeout_s, g.backend_name,
                               checked)
    return dups[desc]


def destroy_process_group(group=None) -> None:
    """Destroy `group` (collective over its members), or every group and the default group.
    NON_GROUP_MEMBER: nothing to do (as torch)."""
    if is_non_member(group):
        return
    if group is None:
        if not _state.initialized:
            return
        gloo = _any_gloo_group()
        for g in reversed(_state.groups):
            _destroy_one(g)
        if _state.owns_torch_dist:
            rendezvous.shutdown_torch_dist()
        _state.reset()
        if gloo:
            _let_gloo_workers_finish()
        return
    g = resolve_group(group)
    _destroy_one(g)
    if g in _state.groups:
        _state.groups.remove(g)
    for torch_pg in [k for k, v in _state.torch_groups.items() if v is g]:
        del _state.torch_groups[torch_pg]   # a later use of that torch group maps it afresh


def _any_gloo_group() -> bool:
    return any(g.backend_name == "gloo" for g in _state.groups)


def _let_gloo_workers_finish() -> None:
    """Give gloo's worker threads the GIL for a moment before the caller can exit.

    NOTE: a gloo worker thread drops its reference to a finished op after the waiter has been
    released; when that is the op's last reference it frees the op's tensors, which needs the
    GIL. If the interpreter is already finalizing then (a script that exits right after
    destroy_process_group), the thread cannot take the GIL and the process aborts with
    "terminate called without an active exception" (seen about 1 run in 10 of
    examples/train_ddp.py on gloo; the core showed ProcessGroupGloo::runLoop in ~AsyncWork ->
    decref_pyobject -> take_gil -> pthread_exit). Sleeping releases the GIL while Python is alive."""
    time.sleep(0.05)


def _gloo_workers_at_exit() -> None:
    """atexit: where a script ends with pynccl's gloo groups alive (it destroyed torch's groups
    only, as nanoGPT's train.py does with pynccl's DDP bootstrapped from torch.distributed, or
    none), gloo's workers get the GIL before finalization, as destroy_process_group gives it
    (_let_gloo_workers_finish: a worker freeing a finished op's tensors during finalization aborts
    the process). The groups themselves are left alone: destroying one waits for its worker
    threads, which a peer's failure could hold for the whole time-out."""
    if _state.initialized and _any_gloo_group():
        _let_gloo_workers_finish()


atexit.register(_gloo_workers_at_exit)


def _destroy_one(g: ProcessGroup):
    be = g.backend
    g.backend = _Unusable(RuntimeError(f"pynccl: process group '{g.name}' was destroyed"))
    if not isinstance(be, _Unusable):
        be.destroy()


def abort_process_group(group=None) -> None:
    """Abort (local) `group` or every group; the groups are unusable after. No peer is waited for;
    NCCL's own abort is waited for at most 10 s per communicator (it does not return while a CUDA
    graph that captured the communicator's collectives is alive; it then finishes in the
    background, csrc/communicator.cpp's abort_bounded)."""
    targets = list(_state.groups) if group is None else [resolve_group(group)]
    for g in targets:
        be = g.backend
        g.backend = _Unusable(RuntimeError(f"pynccl: process group '{g.name}' was aborted"))
        if not isinstance(be, _Unusable):
            be.abort()
    if group is None and _state.initialized:
        _state.reset()
