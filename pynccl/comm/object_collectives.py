"""The pickle-based object collectives, as torch 2.11's: all_gather_object, broadcast_object_list,
gather_object, scatter_object_list, send_object_list, recv_object_list. Each is a few tensor
collectives on the group's device (CUDA on nccl, CPU on gloo), so both backends run them; they are
for metadata, not hot paths. Ranks are global (or group_src / group_dst), as everywhere in
pynccl.comm.distributed; NON_GROUP_MEMBER is treated as torch treats it (membership.py).

`device=` (broadcast_object_list, send_object_list, recv_object_list), with torch's meaning: the
device the pickles travel on. The group's own device type (or None) runs here; the other type
(device="cpu" on an nccl group, "cuda" on a gloo one) is what only a torch group with that
device's backend can carry, so the call is torch's own function on the group's torch twin
(to_torch_group: made on first use, collective over the members, who all make this call).
"""
from __future__ import annotations

import pickle
from typing import List, Optional

import torch
import torch.distributed as tdist

from .collectives import _rooted, _skip, all_gather_into_tensor, broadcast, gather, scatter
from .groups import resolve_group
from .membership import is_non_member, non_member_error, root_rank
from .p2p import recv, send


def _from_bytes(t: torch.Tensor):
    return pickle.loads(t.cpu().numpy().tobytes())


def _object_to_tensor(obj, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _own_device(fn: str, g, device) -> Optional[torch.device]:
    """The device to run on here, or None when `device` is of the other type (torch runs the call)."""
    own = g.backend.device
    if device is None:
        return own
    device = torch.device(device)
    if device.type != own.type:
        return None
    if device.index is not None and own.index is not None and device.index != own.index:
        raise ValueError(f"{fn}: device={device}, but group '{g.name}' runs on {own}; pass {own}, "
                         f"'{own.type}' or None")
    return own


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
    """object_list[i] = rank i's `obj` (group ranks), on every rank."""
    if is_non_member(group):
        return _skip("all_gather_object")
    g = resolve_group(group)
    n = g.world_size
    if not isinstance(object_list, list):
        raise TypeError(f"all_gather_object: object_list must be a list, got {type(object_list).__name__}")
    if len(object_list) != n:
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} entries, expected world_size({n})")
    padded, sizes = padded_object_payload(obj, g)
    max_size = padded.numel()
    out = torch.empty(n * max_size, dtype=torch.uint8, device=g.backend.device)
    all_gather_into_tensor(out, padded, group=g)
    out = out.cpu()
    for i in range(n):
        object_list[i] = pickle.loads(out[i * max_size: i * max_size + int(sizes[i])].numpy().tobytes())


def broadcast_object_list(object_list: list, src: Optional[int] = None, group=None, device=None,
                          group_src: Optional[int] = None) -> None:
    """The other ranks' `object_list` entries become the source's (global rank `src`, or group
    rank `group_src`; default: global rank 0); every rank passes a list of the same length. The
    source's own list is left as it is, as torch's."""
    rooted = _rooted("broadcast_object_list", group, src, group_src, "src", default_root=0)
    if rooted is None:
        return None
    g, root = rooted
    dev = _own_device("broadcast_object_list", g, device)
    if dev is None:
        return tdist.broadcast_object_list(object_list, src=g.ranks[root], group=g.torch_group, device=device)
    is_src = g.group_rank == root
    payloads = [pickle.dumps(o) for o in object_list] if is_src else None
    sizes = (torch.tensor([len(p) for p in payloads], dtype=torch.int64) if is_src
             else torch.empty(len(object_list), dtype=torch.int64)).to(dev)
    broadcast(sizes, group=g, group_src=root)
    data = (torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).to(dev) if is_src
            else torch.empty(int(sizes.sum().item()), dtype=torch.uint8, device=dev))
    if data.numel():
        broadcast(data, group=g, group_src=root)
    if not is_src:
        _unpack(object_list, sizes, data)


def _unpack(object_list: list, sizes: torch.Tensor, data: torch.Tensor) -> None:
    """object_list[i] = the i-th pickle of `data`, `sizes` bytes each, back to back."""
    raw = data.cpu().numpy().tobytes()
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = pickle.loads(raw[offset: offset + size])
        offset += size


def gather_object(obj, object_gather_list: Optional[list] = None, dst: Optional[int] = None, group=None,
                  group_dst: Optional[int] = None) -> None:
    """Rank `dst` (global; or group rank `group_dst`; default: global rank 0) gets every rank's
    `obj`, in group-rank order, in `object_gather_list` (a list of group-size entries there;
    None elsewhere), as torch.distributed.gather_object."""
    rooted = _rooted("gather_object", group, dst, group_dst, "dst", default_root=0)
    if rooted is None:
        return None
    g, root = rooted
    n = g.world_size
    if g.group_rank == root:
        if not isinstance(object_gather_list, list) or len(object_gather_list) != n:
            got = len(object_gather_list) if isinstance(object_gather_list, list) else type(object_gather_list).__name__
            raise ValueError(f"gather_object: object_gather_list on dst must be a list of world_size({n}) "
                             f"entries, got {got}")
    padded, sizes = padded_object_payload(obj, g)
    outs = [torch.empty_like(padded) for _ in range(n)] if g.group_rank == root else None
    gather(padded, outs, group=g, group_dst=root)
    if g.group_rank == root:
        for i in range(n):
            object_gather_list[i] = _from_bytes(outs[i][: int(sizes[i])])


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: Optional[list] = None,
                        src: Optional[int] = None, group=None, group_src: Optional[int] = None) -> None:
    """Rank i of the group gets `scatter_object_input_list[i]` (read on the source only: global
    rank `src`, or group rank `group_src`; default: global rank 0) as
    `scatter_object_output_list[0]`, as torch.distributed.scatter_object_list."""
    rooted = _rooted("scatter_object_list", group, src, group_src, "src", default_root=0)
    if rooted is None:
        return None
    g, root = rooted
    n, dev = g.world_size, g.backend.device
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_list: scatter_object_output_list must be a non-empty list")
    header = 8   # each slot: the pickle's byte count as int64, then the pickle
    if g.group_rank == root:
        if not isinstance(scatter_object_input_list, list) or len(scatter_object_input_list) != n:
            raise ValueError(f"scatter_object_list: scatter_object_input_list on src must be a list of "
                             f"world_size({n}) objects")
        payloads = [pickle.dumps(o) for o in scatter_object_input_list]
        max_size = torch.tensor([max(len(p) for p in payloads)], dtype=torch.int64, device=dev)
    else:
        max_size = torch.zeros(1, dtype=torch.int64, device=dev)
    broadcast(max_size, group=g, group_src=root)
    slot = header + int(max_size.item())
    slots = None
    if g.group_rank == root:
        host = torch.zeros(n, slot, dtype=torch.uint8)
        for i, p in enumerate(payloads):
            host[i, :header] = torch.tensor([len(p)], dtype=torch.int64).view(torch.uint8)
            host[i, header: header + len(p)] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
        slots = list(host.to(dev).unbind(0))
    mine = torch.empty(slot, dtype=torch.uint8, device=dev)
    scatter(mine, slots, group=g, group_src=root)
    mine = mine.cpu()
    size = int(mine[:header].view(torch.int64).item())
    scatter_object_output_list[0] = pickle.loads(mine[header: header + size].numpy().tobytes())


def send_object_list(object_list: list, dst: Optional[int] = None, group=None, device=None,
                     group_dst: Optional[int] = None, use_batch: bool = False) -> None:
    """Send the objects to global rank `dst` (or group rank `group_dst`), which calls
    recv_object_list with a list of the same length: the sizes, then the pickles back to back, as
    torch. use_batch=True sends each through batch_isend_irecv, as torch's."""
    if is_non_member(group):
        raise non_member_error("send_object_list")
    g = resolve_group(group)
    peer = root_rank(g, "send_object_list", dst, group_dst, "dst")
    dev = _own_device("send_object_list", g, device)
    if dev is None:
        return tdist.send_object_list(object_list, dst=g.ranks[peer], group=g.torch_group, device=device,
                                      use_batch=use_batch)
    payloads = [pickle.dumps(o) for o in object_list]
    _p2p(send, use_batch, torch.tensor([len(p) for p in payloads], dtype=torch.int64).to(dev), g, peer)
    _p2p(send, use_batch, torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).to(dev), g, peer)


def recv_object_list(object_list: list, src: Optional[int] = None, group=None, device=None,
                     group_src: Optional[int] = None, use_batch: bool = False) -> int:
    """Fill `object_list` with the objects global rank `src` (or group rank `group_src`) sent with
    send_object_list; returns the sender's global rank. src=None and group_src=None receive from
    any rank (gloo only: NCCL has no any-source receive, and recv(src=None) says so)."""
    if is_non_member(group):
        raise non_member_error("recv_object_list")
    g = resolve_group(group)
    peer = None if src is None and group_src is None else root_rank(g, "recv_object_list", src, group_src, "src")
    dev = _own_device("recv_object_list", g, device)
    if dev is None:
        return tdist.recv_object_list(object_list, src=None if peer is None else g.ranks[peer], group=g.torch_group,
                                      device=device, use_batch=use_batch)
    sizes = torch.empty(len(object_list), dtype=torch.int64, device=dev)
    if peer is None:
        peer = g.to_group_rank(recv(sizes, group=g))
    else:
        _p2p(recv, use_batch, sizes, g, peer)
    data = torch.empty(int(sizes.sum().item()), dtype=torch.uint8, device=dev)
    _p2p(recv, use_batch, data, g, peer)
    _unpack(object_list, sizes, data)
    return g.ranks[peer]


def _p2p(blocking, use_batch: bool, tensor: torch.Tensor, g, peer: int) -> None:
    """One message of send/recv_object_list: a blocking send/recv, or (use_batch) a batch of one."""
    if not use_batch:
        blocking(tensor, group=g, **{"group_dst" if blocking is send else "group_src": peer})
        return
    from .p2p import P2POp, batch_isend_irecv, irecv, isend
    op = isend if blocking is send else irecv
    for work in batch_isend_irecv([P2POp(op, tensor, group=g, group_peer=peer)]):
        work.wait()


__all__: List[str] = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"]
