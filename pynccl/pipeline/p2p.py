"""Pipeline transport: every exchange between pipeline ranks is one grouped batch_isend_irecv
(one NCCL group, sends and receives to both neighbours together), plus the small metadata
messages that let a receiver allocate its buffers.

Shapes travel as int64 tensors: once per step a one-element header (0 = "same shapes as last
step", n > 0 = "n int64 of metadata follow"), and the metadata only when the shapes changed.
The receiver reads the header on the host: one synchronisation per step and stage boundary,
before its first micro-batch; nothing in between micro-batches reads device memory.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..comm import distributed as dist
from ..comm.backends.base import Work
from ..comm.p2p import P2POp, batch_work

# dtype <-> code in the metadata message; append only (codes are part of the wire format).
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
           torch.float8_e4m3fn, torch.float8_e5m2]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class TensorMeta(NamedTuple):
    shape: Tuple[int, ...]
    dtype: torch.dtype



def as_tensor_tuple(out) -> tuple:
    """A stage module's output as the tuple of tensors a stage sends on."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    raise TypeError(f"pipeline stage: the module must return a tensor or a tuple of tensors, "
                    f"got {type(out).__name__}")


def container_of(out):
    """How a stage module returned its outputs: None (a bare tensor), tuple or list; as_returned
    (stage.py) rebuilds it for loss_fn and step()."""
    return None if isinstance(out, torch.Tensor) else tuple if isinstance(out, tuple) else list


def tensor_meta(tensors: Sequence[torch.Tensor]) -> List[TensorMeta]:
    return [TensorMeta(tuple(t.shape), t.dtype) for t in tensors]


def encode_meta(metas: Sequence[TensorMeta]) -> List[int]:
    """[num_tensors, then per tensor: dtype code, ndim, *dims]."""
    out = [len(metas)]
    for m in metas:
        if m.dtype not in _CODE:
            raise TypeError(f"pipeline: cannot send a tensor of dtype {m.dtype} between stages "
                            f"(supported: {', '.join(str(d) for d in _DTYPES)})")
        out += [_CODE[m.dtype], len(m.shape), *m.shape]
    return out


def decode_meta(values: Sequence[int]) -> List[TensorMeta]:
    n, i, metas = values[0], 1, []
    for _ in range(n):
        code, ndim = values[i], values[i + 1]
        metas.append(TensorMeta(tuple(values[i + 2: i + 2 + ndim]), _DTYPES[code]))
        i += 2 + ndim
    if i != len(values):
        raise ValueError(f"pipeline: malformed shape metadata ({len(values)} values, decoded {i})")
    return metas


def _to_device(values: List[int], device: torch.device) -> torch.Tensor:
    """The values as an int64 tensor on `device`, written by fill kernels on the current stream.
    NOTE: no host-to-device copy and no pinned allocation: mid-step (interleaved schedules send
    shapes after messages are already in flight) a page-locked allocation waits for the device,
    whose NCCL kernels wait for the peer, which may wait for this rank's next message: a hang.
    Metadata is a few dozen values, sent once per shape change."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64)
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, v in enumerate(values):
        out[i].fill_(v)
    return out


class PipeTransport:
    """Grouped sends/recvs between the ranks of one pipeline group; peers are pp ranks."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.device = device
        self.pp_rank = group.group_rank
        self.pp_size = group.world_size
        # NOTE: never written after creation, so every step can send the same "unchanged" header.
        self._unchanged = torch.zeros(1, dtype=torch.int64, device=device)
        self.num_meta_sent = 0       # full metadata messages sent (once per shape change)
        if getattr(group.backend, "name", None) == "nccl" and self.pp_size > 1:
            self._connect_neighbours()

    def _connect_neighbours(self, nbytes: int = 1024) -> None:
        """Connect this rank to both ring neighbours, in both directions, now.

        NCCL connects a pair of ranks lazily, inside the first grouped call that uses that
        direction, and the call blocks the host until the peer posts a call using it too. A
        batch holding a send and a receive over a direction not yet connected can then wait for
        a peer that first needs this batch's send (GPipe's first batch on rank 0 is [send the
        activation, receive its gradient]: seen hanging on two H200s). One symmetric exchange
        that every rank of the group makes at construction connects every direction a
        schedule uses (stage k talks to k - 1 and k + 1 on the ring of pp ranks). NCCL connects
        all of a peer's p2p channels at the first use, whatever the size, so the messages are small.
        NOTE: this makes building a schedule collective over the pipeline group on NCCL."""
        nxt, prv = (self.pp_rank + 1) % self.pp_size, (self.pp_rank - 1) % self.pp_size
        n = nbytes // 4
        sends = [(torch.zeros(n, device=self.device), nxt), (torch.zeros(n, device=self.device), prv)]
        recvs = [(torch.empty(n, device=self.device), prv), (torch.empty(n, device=self.device), nxt)]
        self.start(sends, recvs).wait()

    def start(self, sends: List[Tuple[torch.Tensor, int]], recvs: List[Tuple[torch.Tensor, int]]) -> Optional[Work]:
        """Post all sends and recvs as one batch; returns its Work (None if there is nothing).
        Work.wait() makes the current stream wait (NCCL) or waits on the host (gloo)."""
        # Empty tensors carry nothing; both ends know the shapes, so both skip them.
        ops = [P2POp(dist.isend, t, self.group.ranks[peer], self.group) for t, peer in sends if t.numel()]
        ops += [P2POp(dist.irecv, t, self.group.ranks[peer], self.group) for t, peer in recvs if t.numel()]
        if not ops:
            return None
        return batch_work(ops)   # one Work for the batch on either backend (gloo's public batch: one per op)

    # --- shape metadata --------------------------------------------------------------
    def meta_messages(self, metas: List[TensorMeta], last_sent: Optional[List[TensorMeta]]) -> List[torch.Tensor]:
        """What SEND_META sends: the unchanged header, or a header and the new metadata."""
        if last_sent is not None and list(metas) == list(last_sent):
            return [self._unchanged]
        values = encode_meta(metas)
        self.num_meta_sent += 1
        return [_to_device([len(values)], self.device), _to_device(values, self.device)]

    def header_buffer(self) -> torch.Tensor:
        return torch.empty(1, dtype=torch.int64, device=self.device)

    def finish_recv_meta(self, header: torch.Tensor, peer: int,
                         cached: Optional[List[TensorMeta]]) -> List[TensorMeta]:
        """After the header arrived: the metadata in force (cached, or received now from peer).
        NOTE: reads the header on the host; runs once per step, before the first micro-batch."""
        n = int(header.item())
        if n == 0:
            if cached is None:
                raise RuntimeError("pipeline: the previous stage said 'shapes unchanged' before ever "
                                   "sending shapes; the two ranks run different programs")
            return cached
        buf = torch.empty(n, dtype=torch.int64, device=self.device)
        self.start([], [(buf, peer)]).wait()
        return decode_meta(buf.tolist())
