"""Communication hooks for pynccl.DistributedDataParallel (torch's `register_comm_hook` shape).

A hook is `hook(state, bucket: GradBucket) -> obj` where `obj.wait()` returns the reduced flat
gradient (same number of elements as `bucket.buffer()`; any floating dtype). A pynccl Work
makes the current stream wait (no host sync), so `obj.wait()` is cheap; torch futures fit too.

Two differences from torch, both for speed:
  * `bucket.buffer()` already holds the gradients divided by world size (the 1/N scale is
    fused into the pack kernel), so a hook only SUMs; it must not divide again.
  * A hook may carry a `wire_dtype` attribute: DDP then packs the gradients straight into a
    buffer of that dtype (one kernel does scale + cast) and unpacks from it (cast back), so
    fp16/bf16 compression costs no extra launches.
`state` is the pynccl ProcessGroup to reduce over (None: the default group), as in torch.
"""
from __future__ import annotations

from typing import List

import torch

from ..comm import distributed as dist
from ..comm.reduce_op import ReduceOp


class GradBucket:
    """What a hook sees of one bucket (torch.distributed.GradBucket's methods)."""

    def __init__(self, index: int, buffer: torch.Tensor, params: List[torch.Tensor], is_last: bool):
        self._index = index
        self._buffer = buffer
        self._params = params
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """Flat gradients of this bucket, already divided by world size."""
        return self._buffer

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> List[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> List[torch.Tensor]:
        """Views of buffer() shaped like parameters()."""
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset: offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


class _Pending:
    """A started reduction: wait() orders the current stream after it and returns the result."""

    __slots__ = ("_work", "_result")

    def __init__(self, work, result: torch.Tensor):
        self._work = work
        self._result = result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._result


def _sum_all_reduce(group, tensor: torch.Tensor) -> _Pending:
    return _Pending(dist.all_reduce(tensor, ReduceOp.SUM, group=group, async_op=True), tensor)


def allreduce_hook(state, bucket: GradBucket) -> _Pending:
    """SUM all-reduce of the (pre-divided) bucket: the default."""
    return _sum_all_reduce(state, bucket.buffer())


def _compress(state, bucket: GradBucket, dtype: torch.dtype) -> _Pending:
    buf = bucket.buffer()
    # DDP hands over a buffer already in wire_dtype; a caller that does not is still served.
    wire = buf if buf.dtype == dtype else buf.to(dtype)
    return _sum_all_reduce(state, wire)


def fp16_compress_hook(state, bucket: GradBucket) -> _Pending:
    """All-reduce in float16 (half the bytes); gradients are cast back on unpack."""
    return _compress(state, bucket, torch.float16)


def bf16_compress_hook(state, bucket: GradBucket) -> _Pending:
    """All-reduce in bfloat16 (half the bytes, fp32's range); cast back on unpack."""
    return _compress(state, bucket, torch.bfloat16)


fp16_compress_hook.wire_dtype = torch.float16
bf16_compress_hook.wire_dtype = torch.bfloat16

# The built-in hooks: each is a SUM all-reduce of the packed (wire) buffer over `state`'s group,
# so DDP may run pack, all-reduce and unpack of a bucket in one C++ call instead of calling them.
SUM_HOOKS = (allreduce_hook, fp16_compress_hook, bf16_compress_hook)
