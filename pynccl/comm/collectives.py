"""The collectives: torch.distributed 2.11's signatures and semantics (global ranks for src/dst,
or group_src/group_dst; GroupMember.NON_GROUP_MEMBER skipped as torch skips it: membership.py).

Each function checks what is the same for both backends (sizes, dtypes, rank ranges),
translates ranks to group ranks and calls the group's Backend. all_reduce is the hot path: it
does no Python-side checking at all, the backend checks (in C++ for nccl), so a call costs one
Python frame plus the binding. Point-to-point ops are in p2p.py, object collectives in
object_collectives.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from .backends.base import Work, wait_timeout_seconds
from .groups import _state, resolve_group
from .membership import is_non_member, root_rank, warn_not_in_group
from .reduce_op import PremulSum, ReduceOp, as_reduce_op
from .work_future import remember


# ----------------------------------------------------------------------------- checks
def _check_tensor(fn: str, name: str, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_list(fn: str, name: str, lst, n: int, expected: str = "world_size"):
    if not isinstance(lst, (list, tuple)):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got {type(lst).__name__}")
    if len(lst) != n:
        raise ValueError(f"{fn}: {name} has {len(lst)} tensors, expected {expected}({n})")
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
    # NOTE: hot path. No Python-side checks but the op's class (torch's ReduceOp objects are mapped
    # by as_reduce_op); the backend validates the rest (C++ for nccl).
    if op.__class__ is not ReduceOp and op.__class__ is not PremulSum:
        op = as_reduce_op(op, "all_reduce")
    if group is None:
        work = _state.world.backend.all_reduce(tensor, op, async_op)
    else:
        if is_non_member(group):
            return _skip("all_reduce")
        work = resolve_group(group).backend.all_reduce(tensor, op, async_op)
    return work if work is None else _async(work, [tensor])


def _async(work, outputs):
    """An async op's Work, its outputs remembered for Work.get_future (work_future.py)."""
    remember(work, outputs)
    return work


def _ret(work, outputs):
    return work if work is None else _async(work, outputs)


def _skip(op_name: str) -> None:
    """A collective on NON_GROUP_MEMBER: torch's warning, and no op (returns None)."""
    warn_not_in_group(op_name)




def _rooted(fn: str, group, global_root, group_root, what: str, default_root: Optional[int] = None):
    """(group, group-local root) of a rooted op, the root given as torch takes it (`what`: a global
    rank; `group_<what>`: a rank of the group; neither: global `default_root` where torch has one),
    or None where the op is skipped (NON_GROUP_MEMBER, with torch's warning)."""
    if is_non_member(group):
        return _skip(fn)
    if global_root is None and group_root is None:
        global_root = default_root
    g = resolve_group(group)
    return g, root_rank(g, fn, global_root, group_root, what)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    rooted = _rooted("broadcast", group, src, group_src, "src")
    if rooted is None:
        return None
    g, root = rooted
    _check_tensor("broadcast", "tensor", tensor)
    return _ret(g.backend.broadcast(tensor, root, async_op), [tensor])


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    rooted = _rooted("reduce", group, dst, group_dst, "dst")
    if rooted is None:
        return None
    g, root = rooted
    op = as_reduce_op(op, "reduce")
    _check_tensor("reduce", "tensor", tensor)
    return _ret(g.backend.reduce(tensor, root, op, async_op), [tensor])


def _check_list_pair(fn: str, name: str, t: torch.Tensor, list_name: str, lst, n: int):
    """The list all-gather / reduce-scatter: n tensors shaped like `t` (dtype and size)."""
    _check_tensor(fn, name, t)
    _check_list(fn, list_name, lst, n)
    for i, x in enumerate(lst):
        _check_same(fn, name, t, f"{list_name}[{i}]", x, t.numel())


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if is_non_member(group):
        return _skip("all_gather")
    g = resolve_group(group)
    _check_list_pair("all_gather", "tensor", tensor, "tensor_list", tensor_list, g.backend.world_size)
    return _ret(g.backend.all_gather(list(tensor_list), tensor, async_op), list(tensor_list))   # torch: the list


def _check_flat_pair(fn: str, output: torch.Tensor, input: torch.Tensor, n: int, output_is_whole: bool):
    """The one-tensor all-gather / reduce-scatter: output and input tensors of one dtype, the
    whole one n times the size of the per-rank one."""
    _check_tensor(fn, "output", output)
    _check_tensor(fn, "input", input)
    whole_name, whole, part_name, part = ("output", output, "input", input) if output_is_whole else \
        ("input", input, "output", output)
    _check_same(fn, part_name, part, whole_name, whole)
    _check_size_multiple(fn, whole_name, whole, part_name, part, n)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    if is_non_member(group):
        return _skip("all_gather_into_tensor")
    g = resolve_group(group)
    _check_flat_pair("all_gather_into_tensor", output_tensor, input_tensor, g.backend.world_size, output_is_whole=True)
    return _ret(g.backend.all_gather_into_tensor(output_tensor, input_tensor, async_op), [output_tensor])


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    if is_non_member(group):
        return _skip("reduce_scatter")
    op = as_reduce_op(op, "reduce_scatter")
    g = resolve_group(group)
    _check_list_pair("reduce_scatter", "output", output, "input_list", input_list, g.backend.world_size)
    return _ret(g.backend.reduce_scatter(output, list(input_list), op, async_op), [output])


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    if is_non_member(group):
        return _skip("reduce_scatter_tensor")
    op = as_reduce_op(op, "reduce_scatter_tensor")
    g = resolve_group(group)
    _check_flat_pair("reduce_scatter_tensor", output, input, g.backend.world_size, output_is_whole=False)
    return _ret(g.backend.reduce_scatter_tensor(output, input, op, async_op), [output])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    if is_non_member(group):
        return _skip("all_to_all")
    g = resolve_group(group)
    n = g.backend.world_size
    _check_list("all_to_all", "output_tensor_list", output_tensor_list, n)
    _check_list("all_to_all", "input_tensor_list", input_tensor_list, n)
    ref = input_tensor_list[0]
    for t in list(input_tensor_list) + list(output_tensor_list):
        _check_same("all_to_all", "input_tensor_list[0]", ref, "every tensor", t)
    return _ret(g.backend.all_to_all(list(output_tensor_list), list(input_tensor_list), async_op),
                [list(output_tensor_list)])


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
    if is_non_member(group):
        return _skip("all_to_all_single")
    g = resolve_group(group)
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
    return _ret(g.backend.all_to_all_single(output, input, out_splits, in_splits, async_op), [output])


def _rooted_list_args(fn: str, g, tensor, tensor_list, root: int, root_name: str, list_name: str):
    """Checks shared by gather and scatter: the list lives on the root (a group rank) only.
    Returns the list, or None off the root."""
    n = g.backend.world_size
    _check_tensor(fn, "tensor", tensor)
    if g.group_rank != root:
        if tensor_list:
            raise ValueError(f"{fn}: {list_name} must be None or empty on non-{root_name} rank {g.group_rank}")
        return None
    _check_list(fn, f"{list_name} (on the {root_name} rank)", tensor_list, n)
    for i, t in enumerate(tensor_list):
        _check_same(fn, "tensor", tensor, f"{list_name}[{i}]", t, tensor.numel())
    return list(tensor_list)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """dst=None and group_dst=None: global rank 0, as torch."""
    rooted = _rooted("gather", group, dst, group_dst, "dst", default_root=0)
    if rooted is None:
        return None
    g, root = rooted
    gather_list = _rooted_list_args("gather", g, tensor, gather_list, root, "dst", "gather_list")
    return _ret(g.backend.gather(tensor, gather_list, root, async_op), list(gather_list or []))


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """src=None and group_src=None: global rank 0, as torch."""
    rooted = _rooted("scatter", group, src, group_src, "src", default_root=0)
    if rooted is None:
        return None
    g, root = rooted
    scatter_list = _rooted_list_args("scatter", g, tensor, scatter_list, root, "src", "scatter_list")
    return _ret(g.backend.scatter(tensor, scatter_list, root, async_op), [tensor])


def barrier(group=None, async_op=False, device_ids=None):
    """Every rank of the group arrives before any leaves (bounded by the group's timeout).
    async_op=False blocks the host, as torch's. async_op=True returns at once with a Work whose
    wait() blocks the host until every rank has arrived (torch's NCCL barrier Work synchronizes
    too). device_ids, as torch: the barrier's device; a pynccl group has one, so it must be that
    one (nccl), and is unused on gloo (as torch's gloo)."""
    if is_non_member(group):
        return _skip("barrier")
    g = resolve_group(group)
    _check_device_ids(g, device_ids)
    if not async_op:
        g.backend.barrier()
        return None
    return _BarrierWork(g.backend.barrier_work())


def _check_device_ids(g, device_ids) -> None:
    if device_ids is None:
        return
    if not isinstance(device_ids, (list, tuple)) or not all(isinstance(d, int) for d in device_ids):
        raise TypeError(f"barrier: device_ids must be a list of ints (CUDA device indices), got {device_ids!r}")
    dev = g.backend.device
    if dev.type == "cuda" and device_ids and device_ids[0] != dev.index:
        raise ValueError(f"barrier: device_ids={list(device_ids)}, but group '{g.name}' runs on {dev}; pass "
                         f"[{dev.index}] or None")


class _BarrierWork(Work):
    """barrier(async_op=True)'s Work: wait() blocks the host until every rank arrived."""

    def __init__(self, work):
        self._work = work

    def wait(self, timeout=None) -> bool:
        return self._work.synchronize(wait_timeout_seconds(timeout))

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def exception(self):
        return self._work.exception()

    def synchronize(self, timeout_s=None) -> bool:
        return self._work.synchronize(timeout_s)
