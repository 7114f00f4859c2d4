"""The interface both backends implement; everything above it (DDP, ZeRO, TP, PP) is
written once against it and never branches on the backend's name.

Ranks here (root, src, dst, peer) are *group-local* (0 .. world_size-1): the
torch.distributed-like functions in pynccl.comm.distributed translate global ranks first.
Structural checks that do not depend on the backend (list lengths, size and dtype
mismatches, rank ranges) are done once in pynccl.comm.distributed before a backend is called;
a backend checks what only it knows (devices, dtypes it supports).
Every op returns None when async_op=False, else a Work.
"""
from __future__ import annotations

import abc
import datetime
from typing import List, Optional, Sequence, Union

import torch

from ... import _ext
from ..work_future import completed_future, outputs_of, wait_timeout_seconds  # noqa: F401 - re-exported


class Work(abc.ABC):
    """Handle of an op started with async_op=True.

    wait(timeout=None): the caller's current stream (CUDA) waits for the op; on CPU, the host
    waits, bounded by the group's timeout. As torch's Work.wait, a `timeout` (a timedelta, or
    seconds) makes the host wait for the op, at most that long, and raise CommTimeoutError past
    it. is_completed(): non-blocking query; True only once the whole op, including what follows the
    backend's call (gloo's AVG division, a reduce_scatter's copy-out), has written its output.
    result() / is_success() / exception(): torch's (deprecated there, still callable), below.
    """

    @abc.abstractmethod
    def wait(self, timeout: Union[None, float, datetime.timedelta] = None) -> bool: ...

    @abc.abstractmethod
    def is_completed(self) -> bool: ...

    def get_future(self) -> torch.futures.Future:
        """torch's Work.get_future (work_future.py): a future whose value is the op's output tensors.
        This default waits first; GlooWork completes its future from gloo's thread instead."""
        self.wait()
        return completed_future(outputs_of(self))

    def result(self) -> List[torch.Tensor]:
        """torch's Work.result(): the op's output tensors in a list, the value get_future() gives
        (all_reduce: [tensor]), once the op has completed. As torch's gloo Work: RuntimeError before
        (call wait() first). A failed op raises its error (torch would return the unwritten tensors)."""
        if not self.is_completed():
            raise RuntimeError(f"Work.result: {self!r} has not completed; call wait() before result() "
                               f"(torch's gloo Work requires it too)")
        error = self.exception()
        if error is not None:
            raise error
        return list(outputs_of(self))

    def is_success(self) -> bool:
        """torch's Work.is_success(): False once the op has failed, else True (also while it runs,
        as torch's)."""
        return self.exception() is None

    def exception(self) -> Optional[BaseException]:
        """torch's Work.exception(): the op's error once it has failed, else None."""
        raise NotImplementedError(f"Work.exception: {type(self).__name__} keeps no record of its op's error; "
                                  f"wait() raises it")


if _ext._C is not None:
    Work.register(_ext._C.Work)  # C++ Work handles are Works for isinstance checks


class Backend(abc.ABC):
    """One communicator over `world_size` ranks; this process is `rank` in it."""

    name: str                 # "nccl" or "gloo"
    rank: int                 # group-local rank of this process
    world_size: int
    device: torch.device      # where this backend's tensors must live
    timeout_s: float          # bound on every blocking wait of this group (settable)

    # --- collectives -------------------------------------------------------------
    # `output` (keyword, last): None reduces/broadcasts `tensor` in place. A tensor of the same
    # device, dtype and number of elements (contiguous) makes the op out-of-place: `tensor` is
    # only read, `output` receives the result (one NCCL call on nccl; copy + in-place on gloo).
    # reduce writes `output` on the root only; broadcast reads the root's `tensor` and writes
    # every rank's `output`. Bad `output`: TypeError (not a tensor, dtype) / ValueError (rest).
    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op, async_op: bool = False, output: torch.Tensor = None): ...
    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool = False, output: torch.Tensor = None): ...
    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, root: int, op, async_op: bool = False, output: torch.Tensor = None): ...
    @abc.abstractmethod
    def all_gather(self, output_list: List[torch.Tensor], input: torch.Tensor, async_op: bool = False): ...
    @abc.abstractmethod
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False): ...
    @abc.abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input_list: List[torch.Tensor], op, async_op: bool = False): ...
    @abc.abstractmethod
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op, async_op: bool = False): ...
    @abc.abstractmethod
    def all_to_all(self, output_list: List[torch.Tensor], input_list: List[torch.Tensor], async_op: bool = False): ...
    @abc.abstractmethod
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[Sequence[int]], input_split_sizes: Optional[Sequence[int]],
                          async_op: bool = False): ...
    @abc.abstractmethod
    def gather(self, input: torch.Tensor, gather_list: Optional[List[torch.Tensor]], root: int, async_op: bool = False): ...
    @abc.abstractmethod
    def scatter(self, output: torch.Tensor, scatter_list: Optional[List[torch.Tensor]], root: int, async_op: bool = False): ...
    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, peer: int, async_op: bool = False): ...
    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, peer: int, async_op: bool = False): ...

    # torch's `tag` (p2p.py): on gloo a receive takes its peer's send of the same tag. NCCL has no tags
    # (torch's ProcessGroupNCCL ignores them too): these defaults drop the tag; gloo overrides them.
    def send_tagged(self, tensor: torch.Tensor, peer: int, async_op: bool, tag: int):
        return self.send(tensor, peer, async_op)

    def recv_tagged(self, tensor: torch.Tensor, peer: int, async_op: bool, tag: int):
        return self.recv(tensor, peer, async_op)

    def batch_isend_irecv_tagged(self, ops: List[tuple], tags: List[int]):
        """batch_isend_irecv with tags[i] the tag of ops[i]."""
        return self.batch_isend_irecv(ops)
    @abc.abstractmethod
    def batch_isend_irecv(self, ops: List[tuple]):
        """ops: list of (is_send: bool, tensor, group-local peer). One NCCL group. Returns a Work."""

    def batch_isend_irecv_works(self, ops: List[tuple], tags: Optional[List[int]] = None) -> List[Work]:
        """torch's batch_isend_irecv result on this backend: torch's ProcessGroupNCCL coalesces the
        batch into one Work (a list of one); a backend that does not coalesce (gloo) overrides this
        to return one Work per op. `tags`: each op's tag (None: all 0), dropped here as NCCL has none."""
        return [self.batch_isend_irecv(ops)]
    @abc.abstractmethod
    def barrier(self): ...

    def barrier_work(self) -> Work:
        """barrier(async_op=True): the barrier started without a host wait; the Work's synchronize()
        is the wait. A one-element float32 SUM all-reduce, the very op the nccl backend's barrier()
        runs (csrc/collectives.cpp), so ranks may mix the two; gloo overrides it with its barrier."""
        from ..reduce_op import ReduceOp
        return self.all_reduce(torch.zeros(1, device=self.device), ReduceOp.SUM, True)

    def recv_any_source(self, tensor: torch.Tensor, tag: int = 0) -> int:
        """Blocking receive from any rank; returns the sender's group rank. NCCL has none."""
        raise ValueError(f"recv: src=None (receive from any rank) is not possible on the {self.name!r} backend: "
                         f"NCCL has no any-source receive. Pass src= (e.g. send the sender's rank first on a "
                         f"known pair, or exchange it with all_gather_object), or use a gloo group")

    # --- fused bucket kernels (DDP/ZeRO) ------------------------------------------
    @abc.abstractmethod
    def pack(self, tensors: List[torch.Tensor], flat: torch.Tensor, scale: float = 1.0): ...
    @abc.abstractmethod
    def unpack(self, flat: torch.Tensor, tensors: List[torch.Tensor], scale: float = 1.0): ...

    # --- life cycle ----------------------------------------------------------------
    @abc.abstractmethod
    def split(self, ranks: List[int], timeout: float, name: str = ""):
        """Collective over this backend's ranks: returns the backend of the sub-group made of
        group-local `ranks` (sorted) named `name`, or None on ranks not in it."""
    @abc.abstractmethod
    def duplicate(self, timeout: float, name: str):
        """Collective over this backend's ranks only: a second backend over the same ranks, whose
        collectives are ordered apart from this one's (two sequences that may interleave
        differently on different ranks, e.g. ZeRO-3's all-gathers and reduce-scatters)."""
    @abc.abstractmethod
    def destroy(self): ...
    @abc.abstractmethod
    def abort(self): ...
