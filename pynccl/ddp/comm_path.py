"""How DDP's fused buckets reach NCCL (issue 26): where each bucket's wire buffer lives and which
kernels reduce it.

  "default"      ordinary tensors: NCCL's default all-reduce kernels (one CTA per channel,
                 held for the whole collective, beside backward's kernels)
  "symmetric"    one NCCL symmetric window for all buckets: NCCL's symmetric all-reduce kernels
                 (a few CTAs, fp32 accumulation for 16-bit wires)
  "copy_engine"  the same window, each all-reduce split into a symmetric reduce-scatter and an
                 all-gather on the copy engines (no SM)
  "copy_engine_a2a"  the same window, the reduce-scatter as an all-to-all on the copy engines
                 into a scratch buffer of the window, then one local sum of its world slices
                 (a short memory-bound kernel that waits for no peer), then the copy-engine
                 all-gather: no collective kernel holds an SM. The scratch holds the largest
                 bucket, at most SCRATCH_BYTES (a bigger bucket goes through it in slices)
  "auto"         the measured default where it is available (see DEFAULT_PATH): the copy engine
                 where the communicator has copy-engine collectives, else symmetric, else "default"

The result is exact either way: the buckets hold the same values, only the reduction kernel
differs (fp32 sums of two ranks are exact in any order; more ranks reassociate as any NCCL
algorithm choice does). Only built-in hooks on the fused CUDA path use it; a user's hook gets
its bucket as torch's would.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import List, Optional

import torch

from ..comm.symmetric import alloc_symmetric, symmetric_support

COMM_PATHS = ("auto", "default", "symmetric", "copy_engine", "copy_engine_a2a")
_SPLIT_PATHS = ("copy_engine", "copy_engine_a2a")    # the all-reduce split, the all-gather on the copy engines
SCRATCH_BYTES = 64 * 2**20
# Chosen by ddp_bench.py on 2 and 4 x H100 (benchmarks/RESULTS.md, session 13: with the tied tail
# of embedding_rows.py the copy engine measured below symmetric in all four windows; session 15:
# copy_engine_a2a no faster than it, 4xH100 and 2 GPUs).
DEFAULT_PATH = "copy_engine"


@dataclasses.dataclass(frozen=True)
class CommPath:
    """What a reducer's buckets use: `name` (one of COMM_PATHS but "auto"), whether the fused call
    splits the all-reduce, and why a requested path is not used ("" when it is)."""

    name: str
    split_all_reduce: bool = False
    reason: str = ""


def resolve(requested: Optional[str]) -> str:
    """The path asked for: the argument, else PYNCCL_DDP_COMM_PATH, else "auto"."""
    path = requested if requested is not None else os.environ.get("PYNCCL_DDP_COMM_PATH", "auto")
    if path not in COMM_PATHS:
        raise ValueError(f"DistributedDataParallel: comm_path must be one of {', '.join(COMM_PATHS)}, got {path!r}")
    return path


def place_wires(buckets, group, requested: str) -> CommPath:
    """Collective: moves every bucket's wire (b.extra["wire"]) into one symmetric window where
    `requested` and the machine allow, padded to a multiple of the world size; the unpadded
    result (b.extra["result"]) and, for a bucket whose wire is its buffer, the buffer follow.
    Returns the path in use. Every rank decides the same (comm/symmetric.py)."""
    for b in buckets:
        b.extra["result"] = b.extra["wire"]
    if requested == "default":
        return CommPath("default")
    support = symmetric_support(group)
    want = requested
    if requested == "auto":                      # DEFAULT_PATH, or symmetric where NCCL has no copy engine
        want = DEFAULT_PATH if support.copy_engine else "symmetric"
    if want in _SPLIT_PATHS and support.available and not support.copy_engine:
        return _fallback(requested, "default", "the communicator has no copy-engine collectives "
                         "(needs NCCL >= 2.28 and cta_policy=2, pynccl's default there)")
    world_size = group.backend.world_size
    padded = [-(-b.extra["wire"].numel() // world_size) * world_size for b in buckets]
    sizes = [(n, b.extra["wire"].dtype) for n, b in zip(padded, buckets)]
    scratch_sizes = _scratch_sizes(sizes, world_size) if want == "copy_engine_a2a" else []
    views: Optional[List] = alloc_symmetric(group, sizes + scratch_sizes)
    if views is None:
        return _fallback(requested, "default", symmetric_support(group).reason)
    scratch = {dtype: view for (_, dtype), view in zip(scratch_sizes, views[len(buckets):])}
    for b, view in zip(buckets, views):
        if scratch:
            b.extra["scratch"] = scratch[view.dtype]
        wire = b.extra["wire"]
        result = view[: wire.numel()]
        if wire is b.buffer:
            b.rebind(result)          # the gradients' bucket views now live in the window too
        else:
            result.copy_(wire)
        b.extra["wire"], b.extra["result"] = view, result
    return CommPath(want, split_all_reduce=want in _SPLIT_PATHS)


def _scratch_sizes(sizes, world_size: int):
    """copy_engine_a2a's scratch, one per wire dtype: the largest wire of that dtype, at most
    SCRATCH_BYTES, in multiples of 256 x world_size elements (reduce_bucket's slice alignment)."""
    align = 256 * world_size
    out = {}
    for numel, dtype in sizes:
        cap = max(align, SCRATCH_BYTES // torch.empty(0, dtype=dtype).element_size() // align * align)
        out[dtype] = max(out.get(dtype, 0), min(numel, cap))
    return [(n, dtype) for dtype, n in out.items()]


def _fallback(requested: str, name: str, reason: str) -> CommPath:
    if requested != "auto":
        warnings.warn(f"DistributedDataParallel: comm_path={requested!r} is not available here ({reason}); "
                      f"using {name!r}", RuntimeWarning, stacklevel=4)
    return CommPath(name, reason=reason)
