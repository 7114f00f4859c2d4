"""Point-to-point: send / recv / isend / irecv and batch_isend_irecv with torch 2.11's signatures
and semantics (global `dst`/`src`/`peer` or `group_dst`/`group_src`/`group_peer`; NON_GROUP_MEMBER
as torch treats it, membership.py). torch's own P2POp objects are taken by batch_isend_irecv too,
their op mapped by identity (torch.distributed.isend / irecv), never by name.

Tags (`tag=` of every op here and of P2POp): on gloo a receive takes its peer's send of the same tag,
as torch's gloo; on nccl tags are not matched (NCCL has none; torch's ProcessGroupNCCL ignores them
too): sends and receives between two ranks pair in the order they are posted. A tag of 0 takes the
backend's own op (the nccl hot path, straight into C++); another, the backend's `*_tagged` op.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as tdist

from .backends.base import Work
from .collectives import _async, _check_tensor
from .groups import resolve_group
from .membership import is_non_member, non_member_error, root_rank, warn_not_in_group


class P2POp:
    """One send or recv of a batch_isend_irecv call, as torch.distributed.P2POp.

    `op` is pynccl.isend or pynccl.irecv (torch.distributed.isend / irecv are the same ops; the
    strings "isend" / "irecv" are taken too); `peer` a global rank or `group_peer` a rank of
    `group` (exactly one). `tag`: on gloo the receive takes the send of the same tag (torch's gloo);
    on nccl tags are not matched, as in torch (NCCL has none): ops pair in the order they are posted.
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer", "is_send")

    def __init__(self, op, tensor: torch.Tensor, peer: Optional[int] = None, group=None, tag: int = 0,
                 group_peer: Optional[int] = None):
        self.is_send = _is_send_op(op)
        if (peer is None) == (group_peer is None):
            raise ValueError(f"P2POp: pass peer= (a global rank) or group_peer= (a rank of the group), exactly one; "
                             f"got peer={peer}, group_peer={group_peer}")
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer


def _is_send_op(op) -> bool:
    """True for a send, False for a receive: pynccl's or torch's isend / irecv, by identity."""
    if op is isend or op is tdist.isend or op == "isend":
        return True
    if op is irecv or op is tdist.irecv or op == "irecv":
        return False
    raise ValueError(f"P2POp: op must be pynccl.isend or pynccl.irecv (or torch.distributed's), got {op!r}")


def send(tensor, dst=None, group=None, tag=0, group_dst=None) -> None:
    """Blocking send to global rank `dst` (or group rank `group_dst`); not to this rank (torch).
    `tag`: matched by the receive on gloo; not matched on nccl, as in torch (module docstring)."""
    if is_non_member(group):
        raise non_member_error("send")
    g = resolve_group(group)
    peer = root_rank(g, "send", dst, group_dst, "dst")
    _check_tensor("send", "tensor", tensor)
    _check_not_self("send", g, peer, "dst")
    _send(g.backend, tensor, peer, False, tag)


def recv(tensor, src=None, group=None, tag=0, group_src=None) -> int:
    """Receive into `tensor` from global rank `src` (or group rank `group_src`); returns the sender's
    global rank (-1 on NON_GROUP_MEMBER, as torch). src=None and group_src=None receive from
    whichever rank sends (torch's any-source recv): gloo only, NCCL has none (ValueError naming
    the alternatives). `tag`: only a send of the same tag matches on gloo; not matched on nccl, as
    in torch (module docstring)."""
    if is_non_member(group):
        warn_not_in_group("irecv")
        return -1
    g = resolve_group(group)
    _check_tensor("recv", "tensor", tensor)
    if src is None and group_src is None:
        return g.ranks[g.backend.recv_any_source(tensor, tag)]
    peer = root_rank(g, "recv", src, group_src, "src")
    _check_not_self("recv", g, peer, "src")
    _recv(g.backend, tensor, peer, False, tag)
    return g.ranks[peer]


def _send(backend, tensor, peer: int, async_op: bool, tag: int):
    # NOTE: tag 0 calls the backend's own op (on nccl the bound C++ method); another tag its *_tagged op,
    # which gloo passes on to torch and nccl drops (base.Backend).
    return backend.send(tensor, peer, async_op) if tag == 0 else backend.send_tagged(tensor, peer, async_op, tag)


def _recv(backend, tensor, peer: int, async_op: bool, tag: int):
    return backend.recv(tensor, peer, async_op) if tag == 0 else backend.recv_tagged(tensor, peer, async_op, tag)


def _check_not_self(fn: str, g, peer: int, what: str) -> None:
    if peer == g.group_rank:
        raise ValueError(f"{fn}: {what} is this process's own rank ({g.ranks[peer]}); a blocking {fn} to itself "
                         f"never completes (torch refuses it too)")


def isend(tensor, dst=None, group=None, tag=0, group_dst=None) -> Optional[Work]:
    """send without waiting; returns its Work. `tag`: as send's (matched on gloo, not on nccl)."""
    if is_non_member(group):
        warn_not_in_group("isend")
        return None
    g = resolve_group(group)
    peer = root_rank(g, "isend", dst, group_dst, "dst")
    _check_tensor("isend", "tensor", tensor)
    return _async(_send(g.backend, tensor, peer, True, tag), [tensor])


def irecv(tensor, src=None, group=None, tag=0, group_src=None) -> Optional[Work]:
    """recv without waiting; returns its Work. `tag`: as recv's (matched on gloo, not on nccl)."""
    _check_tensor("irecv", "tensor", tensor)
    if is_non_member(group):
        warn_not_in_group("irecv")
        return None
    g = resolve_group(group)
    if src is None and group_src is None:
        raise NotImplementedError("irecv: src=None (any source) is not supported; use the blocking "
                                  "recv(tensor, src=None) on gloo (it returns the sender), or pass src=")
    return _async(_recv(g.backend, tensor, root_rank(g, "irecv", src, group_src, "src"), True, tag), [tensor])


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """All sends and receives of the list at once; returns what torch 2.11 returns for the backend:
    on nccl one Work for the whole batch in a list (torch's ProcessGroupNCCL coalesces the batch),
    on gloo one Work per op, in the list's order (each completes with its own op). torch's P2POp
    objects are taken as well as pynccl's. Each op's tag is matched on gloo, not on nccl (as torch)."""
    g, ops, tags = _batch(p2p_op_list)
    works = g.backend.batch_isend_irecv_works(ops, tags)
    if len(works) == len(ops):   # one Work per op: its future's value is its own tensor
        return [_async(w, [t]) for w, (_, t, _) in zip(works, ops)]
    return [_async(w, [t for _, t, _ in ops]) for w in works]


def batch_work(p2p_op_list: List[P2POp]) -> Work:
    """pynccl's own: the batch as one Work on either backend (one NCCL group), for callers that
    wait on the batch as a whole (pipeline exchanges, per micro-batch). Tags as batch_isend_irecv's."""
    g, ops, tags = _batch(p2p_op_list)
    work = g.backend.batch_isend_irecv(ops) if tags is None else g.backend.batch_isend_irecv_tagged(ops, tags)
    return _async(work, [t for _, t, _ in ops])


def _batch(p2p_op_list):
    """(group, [(is_send, tensor, group-local peer)], the ops' tags or None where all are 0) of a list
    of P2POp (pynccl's or torch's)."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: expected a non-empty list of P2POp")
    if type(p2p_op_list[0]) is not P2POp:
        p2p_op_list = [_from_torch(p, i) for i, p in enumerate(p2p_op_list)]
    first = p2p_op_list[0].group
    if is_non_member(first):
        raise non_member_error("batch_isend_irecv")
    # NOTE: called per micro-batch by pipelines: the common case is one dict lookup per op;
    # messages are built only when something is wrong.
    g = resolve_group(first)
    rank_of = g._group_rank_of
    ops = []
    for p in p2p_op_list:
        if type(p) is not P2POp or p.group is not first or type(p.tensor) is not torch.Tensor:
            _explain_bad_p2p(p2p_op_list)
        if p.group_peer is None:
            peer = rank_of.get(p.peer)
            if peer is None or type(p.peer) is not int:
                g.to_group_rank(p.peer, "peer")  # raises, naming the group
        else:
            peer = root_rank(g, "batch_isend_irecv", None, p.group_peer, "peer")
        ops.append((p.is_send, p.tensor, peer))
    tags = [p.tag for p in p2p_op_list]
    return g, ops, (tags if any(tags) else None)


def _from_torch(p, i: int) -> P2POp:
    """pynccl's P2POp for torch's (op by identity; torch has already resolved the global peer)."""
    if isinstance(p, P2POp):
        return p
    if not isinstance(p, tdist.P2POp):
        raise TypeError(f"batch_isend_irecv: element {i} is {type(p).__name__}, expected pynccl.P2POp or "
                        f"torch.distributed.P2POp")
    return P2POp(p.op, p.tensor, p.peer, p.group, p.tag)


def _explain_bad_p2p(p2p_op_list):
    first = p2p_op_list[0].group
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: element {i} is {type(p).__name__}, expected pynccl.P2POp or "
                            f"torch.distributed.P2POp")
        if p.group is not first:
            raise ValueError("batch_isend_irecv: all ops must use the same group")
        _check_tensor("batch_isend_irecv", f"ops[{i}].tensor", p.tensor)


__all__ = ["P2POp", "send", "recv", "isend", "irecv", "batch_isend_irecv"]
