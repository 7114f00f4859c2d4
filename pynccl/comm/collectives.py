"""The collectives: torch.distributed's signatures, global ranks for src/dst.

Each function checks what is the same for both backends (sizes, dtypes, rank ranges),
translates ranks to group ranks and calls the group's Backend. all_reduce is the hot path: it
does no Python-side checking at all, the backend checks (in C++ for nccl), so a call costs one
Python frame plus the binding.
"""
from __future__ import annotations

import pickle
from typing import List, Optional

import torch

from .backends.base import P2POp, Work
from .groups import _state, resolve_group
from .reduce_op import PremulSum, ReduceOp, as_reduce_op
from .work_future import remember


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
    # NOTE: hot path. No Python-side checks but the op's class (torch's ReduceOp objects are mapped
    # by as_reduce_op); the backend validates the rest (C++ for nccl).
    if op.__class__ is not ReduceOp and op.__class__ is not PremulSum:
        op = as_reduce_op(op, "all_reduce")
    if group is None:
        work = _state.world.backend.all_reduce(tensor, op, async_op)
    else:
        work = resolve_group(group).backend.all_reduce(tensor, op, async_op)
    return work if work is None else _async(work, [tensor])


def _async(work, outputs):
    """An async op's Work, its outputs remembered for Work.get_future (work_future.py)."""
    remember(work, outputs)
    return work


def broadcast(tensor, src, group=None, async_op=False):
    g = resolve_group(group)
    _check_tensor("broadcast", "tensor", tensor)
    return _ret(g.backend.broadcast(tensor, g.to_group_rank(src, "src"), async_op), [tensor])


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    op = as_reduce_op(op, "reduce")
    g = resolve_group(group)
    _check_tensor("reduce", "tensor", tensor)
    return _ret(g.backend.reduce(tensor, g.to_group_rank(dst, "dst"), op, async_op), [tensor])


def _ret(work, outputs):
    return work if work is None else _async(work, outputs)


def _check_list_pair(fn: str, name: str, t: torch.Tensor, list_name: str, lst, n: int):
    """The list all-gather / reduce-scatter: n tensors shaped like `t` (dtype and size)."""
    _check_tensor(fn, name, t)
    _check_list(fn, list_name, lst, n)
    for i, x in enumerate(lst):
        _check_same(fn, name, t, f"{list_name}[{i}]", x, t.numel())


def all_gather(tensor_list, tensor, group=None, async_op=False):
    g = resolve_group(group)
    _check_list_pair("all_gather", "tensor", tensor, "tensor_list", tensor_list, g.backend.world_size)
    return _ret(g.backend.all_gather(list(tensor_list), tensor, async_op), [list(tensor_list)])


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
    g = resolve_group(group)
    _check_flat_pair("all_gather_into_tensor", output_tensor, input_tensor, g.backend.world_size, output_is_whole=True)
    return _ret(g.backend.all_gather_into_tensor(output_tensor, input_tensor, async_op), [output_tensor])


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    op = as_reduce_op(op, "reduce_scatter")
    g = resolve_group(group)
    _check_list_pair("reduce_scatter", "output", output, "input_list", input_list, g.backend.world_size)
    return _ret(g.backend.reduce_scatter(output, list(input_list), op, async_op), [output])


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    op = as_reduce_op(op, "reduce_scatter_tensor")
    g = resolve_group(group)
    _check_flat_pair("reduce_scatter_tensor", output, input, g.backend.world_size, output_is_whole=False)
    return _ret(g.backend.reduce_scatter_tensor(output, input, op, async_op), [output])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
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


def _rooted_list_args(fn: str, g, tensor, tensor_list, root_rank: int, root_name: str, list_name: str):
    """Checks shared by gather and scatter: the list lives on the root only. Returns
    (group-local root, the list or None)."""
    n = g.backend.world_size
    root = g.to_group_rank(root_rank, root_name)
    _check_tensor(fn, "tensor", tensor)
    if g.group_rank != root:
        if tensor_list:
            raise ValueError(f"{fn}: {list_name} must be None or empty on non-{root_name} rank {g.group_rank}")
        return root, None
    _check_list(fn, f"{list_name} (on the {root_name} rank)", tensor_list, n)
    for i, t in enumerate(tensor_list):
        _check_same(fn, "tensor", tensor, f"{list_name}[{i}]", t, tensor.numel())
    return root, list(tensor_list)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    g = resolve_group(group)
    root, gather_list = _rooted_list_args("gather", g, tensor, gather_list, dst, "dst", "gather_list")
    return _ret(g.backend.gather(tensor, gather_list, root, async_op), [gather_list or []])


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    g = resolve_group(group)
    root, scatter_list = _rooted_list_args("scatter", g, tensor, scatter_list, src, "src", "scatter_list")
    return _ret(g.backend.scatter(tensor, scatter_list, root, async_op), [tensor])


def send(tensor, dst, group=None, tag=0):
    g = resolve_group(group)
    _check_tensor("send", "tensor", tensor)
    g.backend.send(tensor, g.to_group_rank(dst, "dst"), False)


def recv(tensor, src=None, group=None, tag=0):
    """Receive into `tensor` from global rank `src`; returns the sender's global rank. src=None
    receives from whichever rank sends (torch's any-source recv): gloo only, NCCL has none
    (ValueError naming the alternatives)."""
    g = resolve_group(group)
    _check_tensor("recv", "tensor", tensor)
    if src is None:
        return g.ranks[g.backend.recv_any_source(tensor)]
    g.backend.recv(tensor, g.to_group_rank(src, "src"), False)
    return src


def isend(tensor, dst, group=None, tag=0) -> Work:
    g = resolve_group(group)
    _check_tensor("isend", "tensor", tensor)
    return _async(g.backend.send(tensor, g.to_group_rank(dst, "dst"), True), [tensor])


def irecv(tensor, src=None, group=None, tag=0) -> Work:
    g = resolve_group(group)
    _check_tensor("irecv", "tensor", tensor)
    if src is None:
        raise NotImplementedError("irecv: src=None (any source) is not supported; use the blocking "
                                  "recv(tensor, src=None) on gloo (it returns the sender), or pass src=")
    return _async(g.backend.recv(tensor, g.to_group_rank(src, "src"), True), [tensor])


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """All sends and receives in one NCCL group; returns one Work per op, as torch's gloo path
    (torch's NCCL path returns one). They are the same Work, the batch's: NCCL runs the batch as
    one group, so waiting on any of them waits for the whole batch."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: expected a non-empty list of pynccl.P2POp")
    # NOTE: called per micro-batch by pipelines: the common case is one dict lookup per op;
    # messages are built only when something is wrong.
    g = resolve_group(p2p_op_list[0].group if isinstance(p2p_op_list[0], P2POp) else None)
    rank_of = g._group_rank_of
    ops = []
    for p in p2p_op_list:
        if type(p) is not P2POp or p.group is not p2p_op_list[0].group or type(p.tensor) is not torch.Tensor:
            _explain_bad_p2p(p2p_op_list)
        peer = rank_of.get(p.peer)
        if peer is None or type(p.peer) is not int:
            g.to_group_rank(p.peer, "peer")  # raises, naming the group
        ops.append((p.is_send, p.tensor, peer))
    work = _async(g.backend.batch_isend_irecv(ops), [t for _, t, _ in ops])
    return [work] * len(ops)


def _explain_bad_p2p(p2p_op_list):
    first = p2p_op_list[0].group if isinstance(p2p_op_list[0], P2POp) else None
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: element {i} is {type(p).__name__}, expected pynccl.P2POp")
        if p.group is not first:
            raise ValueError("batch_isend_irecv: all ops must use the same group")
        _check_tensor("batch_isend_irecv", f"ops[{i}].tensor", p.tensor)


def barrier(group=None, async_op=False, device_ids=None):
    """Blocks the host until every rank of the group arrives (bounded by the group's timeout).
    async_op=True is accepted for torch compatibility and returns an already completed Work;
    device_ids is accepted and ignored (the group's device is known)."""
    resolve_group(group).backend.barrier()
    return _COMPLETED if async_op else None


class _CompletedWork(Work):
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def synchronize(self, timeout_s=None) -> bool:
        return True


_COMPLETED = _CompletedWork()


# ----------------------------------------------------------------------------- objects
def _object_to_tensor(obj, device) -> torch.Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def padded_object_payload(obj, g):
    """(obj pickled into a uint8 tensor padded to the largest payload of group `g`, every rank's
    payload size): the all-gather of sizes that object collectives start with. Collective."""
    dev = g.backend.device
    payload = _object_to_tensor(obj, dev)
    sizes = torch.zeros(g.world_size, dtype=torch.int64, device=dev)
    all_gather_into_tensor(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=dev), group=g)
    padded = torch.zeros(int(sizes.max().item()), dtype=torch.uint8, device=dev)
    padded[: payload.numel()] = payload
    return padded, sizes


def all_gather_object(object_list: list, obj, group=None) -> None:
    """Pickle-based all-gather of Python objects (for metadata, not for hot paths)."""
    g = resolve_group(group)
    n = g.world_size
    if not isinstance(object_list, list):
        raise TypeError(f"all_gather_object: object_list must be a list, got {type(object_list).__name__}")
    if len(object_list) != n:
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} entries, expected world_size({n})")
    dev = g.backend.device
    padded, sizes = padded_object_payload(obj, g)
    max_size = padded.numel()
    out = torch.empty(n * max_size, dtype=torch.uint8, device=dev)
    all_gather_into_tensor(out, padded, group=g)
    out = out.cpu()
    for i in range(n):
        object_list[i] = pickle.loads(out[i * max_size: i * max_size + int(sizes[i])].numpy().tobytes())


def broadcast_object_list(object_list: list, src: int = 0, group=None) -> None:
    """Replace `object_list`'s entries on every rank with those of global rank `src`."""
    g = resolve_group(group)
    dev = g.backend.device
    root = g.to_group_rank(src, "src")
    payload = _object_to_tensor(list(object_list), dev) if g.group_rank == root else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=dev)
    broadcast(size, src, group=g)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    broadcast(payload, src, group=g)
    objs = pickle.loads(payload.cpu().numpy().tobytes())
    object_list[:] = objs
