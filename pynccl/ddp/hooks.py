"""Communication hooks for pynccl.DistributedDataParallel (torch's `register_comm_hook` shape).

A hook is `hook(state, bucket: GradBucket) -> obj` where `obj.wait()` returns the reduced flat
gradient (same number of elements as `bucket.buffer()`; any floating dtype). A pynccl Work
makes the current stream wait (no host sync), so `obj.wait()` is cheap; torch futures fit too.

Torch's semantics: `bucket.buffer()` holds this rank's gradients, NOT divided by world size; a
hook averages (torch's own allreduce_hook, fp16/bf16_compress_hook and PowerSGD divide by their
group's size, and run unchanged here). The built-in hooks below do the same when called, but DDP
recognises them (BUILTIN_HOOKS) and runs them fused instead: the 1/N scale (and the cast to
their `wire_dtype`) folded into the one pack kernel, then a SUM all-reduce of the packed buffer.
A user hook may carry a `wire_dtype` attribute too: DDP then packs into a buffer of that dtype
(the cast fused into the pack; still not divided) and casts back on unpack.
`state` is the pynccl ProcessGroup to reduce over (None: the default group), as in torch.
"""
from __future__ import annotations

from typing import List

import torch

from ..comm import distributed as dist
from ..comm.groups import resolve_group
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
        """Flat gradients of this bucket, summed over this rank's backward, not yet averaged."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat buffer (torch's: e.g. fp16_compress_wrapper puts a cast copy here and
        returns it, reduced, as the result); buffer() and gradients() then read the new one. DDP hands
        each call a bucket over its own buffer again."""
        self._buffer = buffer

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


def sum_all_reduce(state, tensor: torch.Tensor) -> _Pending:
    """SUM all-reduce of `tensor` in place over `state`'s group: what a built-in hook does to a
    bucket DDP has already scaled by 1/N (and cast) in its pack kernel."""
    return _Pending(dist.all_reduce(tensor, ReduceOp.SUM, group=state, async_op=True), tensor)


def hook_world_size(state) -> int:
    """The size of the group a built-in hook averages over (state None: the default group)."""
    return resolve_group(state).world_size


def allreduce_hook(state, bucket: GradBucket) -> _Pending:
    """Average over `state`'s group: divide by its size, SUM all-reduce (torch's allreduce_hook)."""
    buf = bucket.buffer()
    buf.div_(hook_world_size(state))
    return sum_all_reduce(state, buf)


class _Decompressed(_Pending):
    """wait() casts the reduced wire buffer back into the bucket's buffer and returns that."""

    __slots__ = ("_target",)

    def __init__(self, work, result: torch.Tensor, target: torch.Tensor):
        super().__init__(work, result)
        self._target = target

    def wait(self) -> torch.Tensor:
        return self._target.copy_(super().wait())


def _compress(state, bucket: GradBucket, dtype: torch.dtype) -> _Pending:
    """torch's _compress_hook: cast, divide by the group's size, SUM all-reduce, cast back."""
    buf = bucket.buffer()
    wire = buf.to(dtype).div_(hook_world_size(state))
    pending = sum_all_reduce(state, wire)
    return pending if buf.dtype == dtype else _Decompressed(pending._work, wire, buf)


def fp16_compress_hook(state, bucket: GradBucket) -> _Pending:
    """All-reduce in float16 (half the bytes); gradients are cast back on unpack."""
    return _compress(state, bucket, torch.float16)


def bf16_compress_hook(state, bucket: GradBucket) -> _Pending:
    """All-reduce in bfloat16 (half the bytes, fp32's range); cast back on unpack."""
    return _compress(state, bucket, torch.bfloat16)


fp16_compress_hook.wire_dtype = torch.float16
bf16_compress_hook.wire_dtype = torch.bfloat16

# The built-in hooks: each averages `state`'s group with a SUM all-reduce of the bucket cast to
# its wire_dtype, so DDP runs them fused (pack with scale 1/N and cast, then sum_all_reduce; on
# CUDA pack and all-reduce are one C++ call) instead of calling them.
BUILTIN_HOOKS = (allreduce_hook, fp16_compress_hook, bf16_compress_hook)
