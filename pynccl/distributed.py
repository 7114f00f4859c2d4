"""torch.distributed-like API: process groups, rendezvous, and every collective.

Functions here take *global* ranks (as torch.distributed does), check what is the same for
both backends (sizes, dtypes, rank ranges), translate ranks to group ranks and call the
group's Backend. all_reduce is the hot path: it does no Python-side checking at all, the
backend checks (in C++ for nccl), so a call costs one Python frame plus the binding.
"""
from __future__ import annotations

import datetime
import os
import pickle
from typing import List, Optional, Sequence

import torch

from . import rendezvous
from .backends.base import Backend, P2POp, Work
from .errors import PyncclError
from .reduce_op import ReduceOp

DEFAULT_TIMEOUT_S = 600.0


class _Unusable:
    """Stands in for a group's backend where no op may run; every use raises `error`."""

    __slots__ = ("_error",)

    def __init__(self, error: Exception):
        self._error = error

    def __getattr__(self, name):
        raise self._error


class ProcessGroup:
    """A set of global ranks and the Backend that talks to them.

    `rank` / `world_size` are this process's position in the group (like
    torch.distributed.get_rank(group)); `ranks` are the global ranks, in group order.
    """

    def __init__(self, backend, ranks: Sequence[int], name: str, timeout_s: float, backend_name: str):
        self.backend = backend
        self.ranks = list(ranks)
        self.name = name
        self.timeout_s = timeout_s
        self.backend_name = backend_name
        self._group_rank_of = {g: i for i, g in enumerate(self.ranks)}
        self.rank = -1 if isinstance(backend, _Unusable) else backend.rank
        self.world_size = len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def size(self) -> int:
        return self.world_size

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Group rank of `global_rank`; ValueError naming the group if it is not in it."""
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{what} must be an int (a global rank), got {type(global_rank).__name__}")
        idx = self._group_rank_of.get(global_rank)
        if idx is None:
            raise ValueError(f"{what}={global_rank} is not a rank of group '{self.name}' "
                             f"(global ranks {self.ranks})")
        return idx

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self):
        return f"ProcessGroup(name={self.name!r}, backend={self.backend_name!r}, ranks={self.ranks}, rank={self.rank})"


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


_state = _State()


# ----------------------------------------------------------------------------- init/groups
def _timeout_seconds(timeout) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return float(timeout)


def _make_backend(backend: str, rank: int, world_size: int, timeout_s: float, device_id, store, prefix: str):
    if backend == "gloo":
        from .backends.gloo import GlooBackend
        return GlooBackend.from_default_group(timeout_s)
    from .backends.nccl import NcclBackend
    device = rendezvous.resolve_cuda_device(device_id)
    unique_id = rendezvous.exchange_unique_id(store, prefix, rank, timeout_s)
    return NcclBackend.create(unique_id, world_size, rank, device, timeout_s, name="world")


def init_process_group(backend: str = "nccl", init_method: Optional[str] = "env://", world_size: int = -1,
                       rank: int = -1, timeout=None, device_id=None, store=None,
                       check_collectives: Optional[bool] = None) -> None:
    """Create the default group over all ranks.

    Reads the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
    unless rank/world_size/store are given. If torch.distributed is already initialised,
    its rank, world size and store are reused, so scripts that set it up keep working.
    A gloo torch.distributed default group is always present afterwards (it carries the
    CPU-side helpers such as DistributedSampler and object collectives).
    check_collectives (default: PYNCCL_CHECK_COLLECTIVES=1): compare every collective's
    signature across ranks through the store first (see collective_check.py).
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"init_process_group: backend must be 'nccl' or 'gloo', got {backend!r}")
    if _state.initialized:
        raise RuntimeError("init_process_group: the default process group is already initialized; "
                           "call pynccl.destroy_process_group() first")
    timeout_s = _timeout_seconds(timeout)
    if backend == "nccl":
        from ._ext import require_extension
        require_extension("backend='nccl'")
    rank, world_size, store, owns = rendezvous.bootstrap(init_method, rank, world_size, timeout_s, store)
    prefix = f"pynccl/{rendezvous.next_generation()}"
    be = _make_backend(backend, rank, world_size, timeout_s, device_id, store, prefix)
    _state.store = store
    if check_collectives is None:
        check_collectives = os.environ.get("PYNCCL_CHECK_COLLECTIVES", "0") == "1"
    _state.check_collectives = check_collectives
    _state.world = ProcessGroup(_maybe_checked(be, "world"), range(world_size), "world", timeout_s, backend)
    _state.owns_torch_dist = owns
    _state.initialized = True
    _state.groups = [_state.world]


def _maybe_checked(backend, name: str):
    if not _state.check_collectives:
        return backend
    from .collective_check import CheckedBackend
    return CheckedBackend(backend, _state.store, name)


def flight_record(group=None) -> List[dict]:
    """The group's last collectives (oldest first): op, seq, dtype, count, peer, state,
    enqueue_time_us. Also written as JSON when an op of the group fails or times out."""
    return _group(group).backend.flight_record()


def is_initialized() -> bool:
    return _state.initialized


def _group(group) -> ProcessGroup:
    if group is None:
        return _state.world
    if type(group) is not ProcessGroup:
        raise TypeError(f"group must be a pynccl ProcessGroup (from pynccl.new_group) or None, "
                        f"got {type(group).__name__}")
    return group


def get_default_group() -> ProcessGroup:
    _state.world.backend.rank  # raises if uninitialized
    return _state.world


def get_store():
    """The rendezvous TCPStore (for side-channel checks); raises before init."""
    _state.world.backend.rank
    return _state.store


def get_rank(group=None) -> int:
    g = _group(group)
    if g is _state.world:
        g.backend.rank  # raises if uninitialized
    return g.rank


def get_world_size(group=None) -> int:
    g = _group(group)
    if g is _state.world:
        g.backend.rank
    return g.world_size


def get_backend(group=None) -> str:
    g = _group(group)
    g.backend.rank
    return g.backend_name


def get_device(group=None) -> torch.device:
    """The device this group's tensors must live on (cuda:N for nccl, cpu for gloo)."""
    return _group(group).backend.device


def get_process_group_ranks(group=None) -> List[int]:
    return list(_group(group).ranks)


def new_group(ranks: Optional[Sequence[int]] = None, timeout=None, backend: Optional[str] = None) -> ProcessGroup:
    """A group over the given global ranks. Collective over the default group: every rank
    calls it with the same `ranks`, members and non-members alike (as in torch).
    On a rank outside `ranks`, the returned group raises on use."""
    world = get_default_group()
    if backend is not None and backend != world.backend_name:
        raise ValueError(f"new_group: backend {backend!r} differs from the default group's "
                         f"{world.backend_name!r}; pynccl groups share the default group's backend")
    if ranks is None:
        ranks = list(range(world.world_size))
    ranks = list(ranks)
    if not ranks:
        raise ValueError("new_group: ranks must not be empty")
    for r in ranks:
        if not isinstance(r, int) or not 0 <= r < world.world_size:
            raise ValueError(f"new_group: rank {r!r} out of range [0, {world.world_size})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group: ranks contain duplicates: {ranks}")
    ranks = sorted(ranks)
    timeout_s = _timeout_seconds(timeout) if timeout is not None else world.timeout_s
    _state.num_groups_created += 1
    name = f"group{_state.num_groups_created}"
    sub = world.backend.split(ranks, timeout_s, name)
    if sub is None:
        me = world.rank
        sub = _Unusable(ValueError(f"rank {me} is not a member of group '{name}' (global ranks {ranks})"))
    else:
        sub = _maybe_checked(sub, name)
    group = ProcessGroup(sub, ranks, name, timeout_s, world.backend_name)
    _state.groups.append(group)
    return group


def destroy_process_group(group=None) -> None:
    """Destroy `group` (collective over its members), or every group and the default group."""
    if group is None:
        if not _state.initialized:
            return
        for g in reversed(_state.groups):
            _destroy_one(g)
        if _state.owns_torch_dist:
            rendezvous.shutdown_torch_dist()
        _state.reset()
        return
    g = _group(group)
    _destroy_one(g)
    if g in _state.groups:
        _state.groups.remove(g)


def _destroy_one(g: ProcessGroup):
    be = g.backend
    g.backend = _Unusable(RuntimeError(f"pynccl: process group '{g.name}' was destroyed"))
    if not isinstance(be, _Unusable):
        be.destroy()


def abort_process_group(group=None) -> None:
    """Abort (local, never blocks) `group` or every group; the groups are unusable after."""
    targets = list(_state.groups) if group is None else [_group(group)]
    for g in targets:
        be = g.backend
        g.backend = _Unusable(RuntimeError(f"pynccl: process group '{g.name}' was aborted"))
        if not isinstance(be, _Unusable):
            be.abort()
    if group is None and _state.initialized:
        _state.reset()


# ----------------------------------------------------------------------------- checks
def _check_tensor(fn: str, name: str, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_list(fn: str, name: str, lst, n: int):
    if not isinstance(lst, (list, tuple)):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got {type(lst).__name__}")
    if len(lst) != n:
        raise ValueError(f"{fn}: {name} has {len(lst)} tensors, expected world_size({n})")
    for i, t in enumerate(lst):
        _check_tensor(fn, f"{name}[{i}]", t)


def _check_same(fn: str, ref_name: str, ref: torch.Tensor, name: str, t: torch.Tensor, numel: Optional[int] = None):
    if t.dtype != ref.dtype:
        raise TypeError(f"{fn}: {name} has dtype {t.dtype}, expected {ref_name}'s dtype {ref.dtype}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements, expected {numel}")


def _check_size_multiple(fn: str, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor, n: int):
    if big.numel() != n * small.numel():
        raise ValueError(f"{fn}: {big_name} has {big.numel()} elements, expected "
                         f"world_size({n}) × {small_name}({small.numel()}) = {n * small.numel()}")


# ----------------------------------------------------------------------------- collectives
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    # NOTE: hot path. No Python-side checks: the backend validates (C++ for nccl).
    if group is None:
        return _state.world.backend.all_reduce(tensor, op, async_op)
    return _group(group).backend.all_reduce(tensor, op, async_op)


def broadcast(tensor, src, group=None, async_op=False):
    g = _group(group)
    _check_tensor("broadcast", "tensor", tensor)
    return g.backend.broadcast(tensor, g.group_rank(src, "src"), async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    _check_tensor("reduce", "tensor", tensor)
    return g.backend.reduce(tensor, g.group_rank(dst, "dst"), op, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    _check_tensor("all_gather", "tensor", tensor)
    _check_list("all_gather", "tensor_list", tensor_list, n)
    for i, t in enumerate(tensor_list):
        _check_same("all_gather", "tensor", tensor, f"tensor_list[{i}]", t, tensor.numel())
    return g.backend.all_gather(list(tensor_list), tensor, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    fn = "all_gather_into_tensor"
    _check_tensor(fn, "output", output_tensor)
    _check_tensor(fn, "input", input_tensor)
    _check_same(fn, "input", input_tensor, "output", output_tensor)
    _check_size_multiple(fn, "output", output_tensor, "input", input_tensor, n)
    return g.backend.all_gather_into_tensor(output_tensor, input_tensor, async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    _check_tensor("reduce_scatter", "output", output)
    _check_list("reduce_scatter", "input_list", input_list, n)
    for i, t in enumerate(input_list):
        _check_same("reduce_scatter", "output", output, f"input_list[{i}]", t, output.numel())
    return g.backend.reduce_scatter(output, list(input_list), op, async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    fn = "reduce_scatter_tensor"
    _check_tensor(fn, "output", output)
    _check_tensor(fn, "input", input)
    _check_same(fn, "output", output, "input", input)
    _check_size_multiple(fn, "input", input, "output", output, n)
    return g.backend.reduce_scatter_tensor(output, input, op, async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    _check_list("all_to_all", "output_tensor_list", output_tensor_list, n)
    _check_list("all_to_all", "input_tensor_list", input_tensor_list, n)
    ref = input_tensor_list[0]
    for t in list(input_tensor_list) + list(output_tensor_list):
        _check_same("all_to_all", "input_tensor_list[0]", ref, "every tensor", t)
    return g.backend.all_to_all(list(output_tensor_list), list(input_tensor_list), async_op)


def _check_splits(fn: str, name: str, splits, t: torch.Tensor, n: int):
    if splits is None or len(splits) == 0:
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(f"{fn}: {name} dim 0 ({tuple(t.shape)}) must divide evenly by "
                             f"world_size({n}) when no split sizes are given")
        return None
    splits = [int(s) for s in splits]
    if len(splits) != n:
        raise ValueError(f"{fn}: {name}_split_sizes has {len(splits)} entries, expected world_size({n})")
    if any(s < 0 for s in splits):
        raise ValueError(f"{fn}: {name}_split_sizes must be non-negative, got {splits}")
    if t.dim() == 0 or sum(splits) != t.shape[0]:
        raise ValueError(f"{fn}: {name}_split_sizes sum to {sum(splits)}, expected {name}.shape[0] "
                         f"({t.shape[0] if t.dim() else 'scalar'})")
    return splits


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    fn = "all_to_all_single"
    _check_tensor(fn, "output", output)
    _check_tensor(fn, "input", input)
    _check_same(fn, "input", input, "output", output)
    out_splits = _check_splits(fn, "output", output_split_sizes, output, n)
    in_splits = _check_splits(fn, "input", input_split_sizes, input, n)
    if out_splits is None and in_splits is None and output.numel() != input.numel():
        raise ValueError(f"{fn}: output has {output.numel()} elements, expected input's {input.numel()} "
                         f"when no split sizes are given")
    if output.dim() and input.dim() and output[0:0].shape[1:] != input[0:0].shape[1:]:
        raise ValueError(f"{fn}: output rows have shape {tuple(output.shape[1:])}, input rows "
                         f"{tuple(input.shape[1:])}; they must match")
    return g.backend.all_to_all_single(output, input, out_splits, in_splits, async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    root = g.group_rank(dst, "dst")
    _check_tensor("gather", "tensor", tensor)
    if g.rank == root:
        _check_list("gather", "gather_list (on the dst rank)", gather_list, n)
        for i, t in enumerate(gather_list):
            _check_same("gather", "tensor", tensor, f"gather_list[{i}]", t, tensor.numel())
    elif gather_list:
        raise ValueError(f"gather: gather_list must be None or empty on non-dst rank {g.rank}")
    return g.backend.gather(tensor, list(gather_list) if g.rank == root else None, root, async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    g = _group(group)
    n = g.backend.world_size
    root = g.group_rank(src, "src")
    _check_tensor("scatter", "tensor", tensor)
    if g.rank == root:
        _check_list("scatter", "scatter_list (on the src rank)", scatter_list, n)
        for i, t in enumerate(scatter_list):
            _check_same("scatter", "tensor", tensor, f"scatter_list[{i}]", t, tensor.numel())
    elif scatter_list:
        raise ValueError(f"scatter: scatter_list must be None or empty on non-src rank {g.rank}")
    return g.backend.scatter(tensor, list(scatter_list) if g.rank == root else None, root, async_op)


def send(tensor, dst, group=None, tag=0):
    g = _group(group)
    _check_tensor("send", "tensor", tensor)
    g.backend.send(tensor, g.group_rank(dst, "dst"), False)


def recv(tensor, src, group=None, tag=0):
    g = _group(group)
    _check_tensor("recv", "tensor", tensor)
    g.backend.recv(tensor, g.group_rank(src, "src"), False)
    return src


def isend(tensor, dst, group=None, tag=0) -> Work:
    g = _group(group)
    _check_tensor("isend", "tensor", tensor)
    return g.backend.send(tensor, g.group_rank(dst, "dst"), True)


def irecv(tensor, src, group=None, tag=0) -> Work:
    g = _group(group)
    _check_tensor("irecv", "tensor", tensor)
    return g.backend.recv(tensor, g.group_rank(src, "src"), True)


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """All sends and receives in one NCCL group; returns a one-element list of Work
    (torch returns one Work per op; waiting on any of ours waits for the whole batch)."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: expected a non-empty list of pynccl.P2POp")
    g = None
    ops = []
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: element {i} is {type(p).__name__}, expected pynccl.P2POp")
        pg = _group(p.group)
        if g is None:
            g = pg
        elif pg is not g:
            raise ValueError("batch_isend_irecv: all ops must use the same group")
        _check_tensor("batch_isend_irecv", f"ops[{i}].tensor", p.tensor)
        ops.append((p.is_send, p.tensor, g.group_rank(p.peer, f"ops[{i}].peer")))
    return [g.backend.batch_isend_irecv(ops)]


def barrier(group=None, async_op=False, device_ids=None):
    """Blocks the host until every rank of the group arrives (bounded by the group's timeout)."""
    _group(group).backend.barrier()


# ----------------------------------------------------------------------------- objects
def _object_to_tensor(obj, device) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def all_gather_object(object_list: list, obj, group=None) -> None:
    """Pickle-based all-gather of Python objects (for metadata, not for hot paths)."""
    g = _group(group)
    n = g.world_size
    if not isinstance(object_list, list) or len(object_list) != n:
        raise ValueError(f"all_gather_object: object_list must be a list of world_size({n}) entries")
    dev = g.backend.device
    payload = _object_to_tensor(obj, dev)
    sizes = torch.zeros(n, dtype=torch.int64, device=dev)
    all_gather_into_tensor(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=dev), group=g)
    max_size = int(sizes.max().item())
    padded = torch.zeros(max_size, dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    out = torch.empty(n * max_size, dtype=torch.uint8, device=dev)
    all_gather_into_tensor(out, padded, group=g)
    out = out.cpu()
    for i in range(n):
        object_list[i] = pickle.loads(out[i * max_size: i * max_size + int(sizes[i])].numpy().tobytes())


def broadcast_object_list(object_list: list, src: int = 0, group=None) -> None:
    """Replace `object_list`'s entries on every rank with those of global rank `src`."""
    g = _group(group)
    dev = g.backend.device
    root = g.group_rank(src, "src")
    payload = _object_to_tensor(list(object_list), dev) if g.rank == root else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=dev)
    broadcast(size, src, group=g)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    broadcast(payload, src, group=g)
    objs = pickle.loads(payload.cpu().numpy().tobytes())
    object_list[:] = objs
