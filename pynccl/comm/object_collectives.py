"""The pickle-based object collectives torch has beyond all_gather_object / broadcast_object_list:
gather_object, scatter_object_list, send_object_list, recv_object_list. Each is a few tensor
collectives on the group's device (CUDA on nccl, CPU on gloo), so both backends run them; they are
for metadata, not hot paths. Ranks are global, as everywhere in pynccl.comm.distributed.
"""
from __future__ import annotations

import pickle
from typing import List, Optional

import torch

from .collectives import broadcast, gather, padded_object_payload, recv, scatter, send
from .groups import resolve_group


def _from_bytes(t: torch.Tensor):
    return pickle.loads(t.cpu().numpy().tobytes())


def gather_object(obj, object_gather_list: Optional[list] = None, dst: int = 0, group=None) -> None:
    """Rank `dst` gets every rank's `obj`, in group-rank order, in `object_gather_list` (a list
    of group-size entries on dst; None elsewhere), as torch.distributed.gather_object."""
    g = resolve_group(group)
    n = g.world_size
    root = g.to_group_rank(dst, "dst")
    if g.group_rank == root:
        if not isinstance(object_gather_list, list) or len(object_gather_list) != n:
            got = len(object_gather_list) if isinstance(object_gather_list, list) else type(object_gather_list).__name__
            raise ValueError(f"gather_object: object_gather_list on dst must be a list of world_size({n}) "
                             f"entries, got {got}")
    padded, sizes = padded_object_payload(obj, g)
    outs = [torch.empty_like(padded) for _ in range(n)] if g.group_rank == root else None
    gather(padded, outs, dst=dst, group=g)
    if g.group_rank == root:
        for i in range(n):
            object_gather_list[i] = _from_bytes(outs[i][: int(sizes[i])])


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: Optional[list] = None,
                        src: int = 0, group=None) -> None:
    """Rank i of the group gets `scatter_object_input_list[i]` (read on `src` only) as
    `scatter_object_output_list[0]`, as torch.distributed.scatter_object_list."""
    g = resolve_group(group)
    n, dev = g.world_size, g.backend.device
    root = g.to_group_rank(src, "src")
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
    broadcast(max_size, src, group=g)
    slot = header + int(max_size.item())
    slots = None
    if g.group_rank == root:
        host = torch.zeros(n, slot, dtype=torch.uint8)
        for i, p in enumerate(payloads):
            host[i, :header] = torch.tensor([len(p)], dtype=torch.int64).view(torch.uint8)
            host[i, header: header + len(p)] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
        slots = list(host.to(dev).unbind(0))
    mine = torch.empty(slot, dtype=torch.uint8, device=dev)
    scatter(mine, slots, src=src, group=g)
    mine = mine.cpu()
    size = int(mine[:header].view(torch.int64).item())
    scatter_object_output_list[0] = pickle.loads(mine[header: header + size].numpy().tobytes())


def send_object_list(object_list: list, dst: int, group=None, device=None) -> None:
    """Send the objects to global rank `dst` (which calls recv_object_list with a list of the same
    length): the sizes, then the pickles back to back, as torch. `device` is accepted for torch's
    signature; the group's device is used."""
    g = resolve_group(group)
    dev = g.backend.device
    payloads = [pickle.dumps(o) for o in object_list]
    send(torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=dev), dst, group=g)
    send(torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).to(dev), dst, group=g)


def recv_object_list(object_list: list, src: Optional[int] = None, group=None, device=None) -> int:
    """Fill `object_list` with the objects global rank `src` sent with send_object_list; returns
    the sender's global rank. src=None receives from any rank (gloo only: NCCL has no any-source
    receive, and recv(src=None) says so)."""
    g = resolve_group(group)
    dev = g.backend.device
    sizes = torch.empty(len(object_list), dtype=torch.int64, device=dev)
    sender = recv(sizes, src, group=g)
    data = torch.empty(int(sizes.sum().item()), dtype=torch.uint8, device=dev)
    recv(data, sender, group=g)
    data = data.cpu().numpy().tobytes()
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = pickle.loads(data[offset: offset + size])
        offset += size
    return sender


__all__: List[str] = ["gather_object", "scatter_object_list", "send_object_list", "recv_object_list"]
