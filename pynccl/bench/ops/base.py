"""What one collective adds to the shared harness, as nccl-tests' per-op files do: its byte
counts, where each rank's input lands (from which the expected values follow), its bus-bandwidth
factor, and the call. Everything else (sweep, timing, checking, printing) lives in the harness.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

ALL = -1  # Segment.src_rank: the reduction, with the run's redop, over every rank's input


@dataclass(frozen=True)
class Counts:
    """Element counts of one size, nccl-tests' getCollByteCount: send/recv buffer lengths, the
    count NCCL is called with (the "count" column), and the in-place offsets (× rank) of the
    send and recv regions inside the receive buffer."""
    send: int
    recv: int
    param: int
    send_inplace_offset: int = 0
    recv_inplace_offset: int = 0


@dataclass(frozen=True)
class Segment:
    """recv[dst : dst+length] must equal input(src_rank)[src : src+length] (or, for ALL, the
    reduction of every rank's input over that range)."""
    dst: int
    length: int
    src_rank: int
    src: int


@dataclass(frozen=True)
class CallSpec:
    """What a call needs besides its buffers; `redop` is already the implementation's own object."""
    rank: int
    nranks: int
    root: int
    redop: object
    counts: Counts


def per_rank_count(count: int, nranks: int, elem_size: int) -> int:
    """count // nranks, rounded down so that it spans a multiple of 16 bytes (nccl-tests' alignment)."""
    c = count // nranks
    return (c * elem_size // 16) * 16 // elem_size


def whole_counts(count: int) -> Counts:
    """Ops that move `count` elements per rank: all_reduce, broadcast, reduce, sendrecv."""
    return Counts(send=count, recv=count, param=count)


def gathering_counts(count: int, nranks: int, elem_size: int) -> Counts:
    """c in, n·c out (all_gather, gather); in place, the input is the rank's chunk of the output."""
    c = per_rank_count(count, nranks, elem_size)
    return Counts(send=c, recv=c * nranks, param=c, send_inplace_offset=c)


def scattering_counts(count: int, nranks: int, elem_size: int) -> Counts:
    """n·c in, c out (reduce_scatter, scatter); in place, the output is the rank's chunk of the input."""
    c = per_rank_count(count, nranks, elem_size)
    return Counts(send=c * nranks, recv=c, param=c, recv_inplace_offset=c)


def copy_then(send: torch.Tensor, recv: torch.Tensor, fn, *args) -> Callable[[], None]:
    """Out-of-place through an in-place API (all_reduce, broadcast, reduce take one tensor, as in
    torch.distributed): copy the input into the output, then fn(*args). Both implementations pay it."""
    copy = recv.copy_

    def out_of_place():
        copy(send)
        fn(*args)
    return out_of_place


def out_of_place_call(impl, method: str, send: torch.Tensor, recv: torch.Tensor, *args) -> Optional[Callable[[], None]]:
    """The true out-of-place op where the implementation has one: backend.<method>(send, *args,
    output=recv), one NCCL call as nccl-tests makes; None otherwise (then copy_then)."""
    backend = impl.out_of_place_backend()
    if backend is None:
        return None
    return functools.partial(getattr(backend, method), send, *args, output=recv)


class Collective:
    name: str = ""
    has_redop: bool = False
    has_root: bool = False
    # False where NCCL leaves in-place results undefined (send and receive buffer are the same
    # memory for alltoall and sendrecv): nccl-tests times them but prints N/A for #wrong.
    in_place_checked: bool = True

    @property
    def perf_name(self) -> str:
        return f"{self.name}_perf"

    def counts(self, count: int, nranks: int, elem_size: int) -> Counts:
        raise NotImplementedError

    def bus_factor(self, nranks: int) -> float:
        raise NotImplementedError

    def expected(self, rank: int, nranks: int, root: int, counts: Counts) -> List[Segment]:
        raise NotImplementedError

    def make_call(self, impl, send: torch.Tensor, recv: torch.Tensor, in_place: bool,
                  spec: CallSpec) -> Callable[[], None]:
        """A no-argument callable that enqueues one op. It runs inside the timed loop: bind
        everything it needs now, so that a call costs only what the API itself costs."""
        raise NotImplementedError
