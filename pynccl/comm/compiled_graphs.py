"""CUDA graphs that torch.compile keeps (mode="reduce-overhead": inductor's CUDA-graph trees) and
a communicator's end.

NCCL does not finish destroying or aborting a communicator while a CUDA graph that captured one of
its collectives is alive (commDestroySync polls until no graph references it; NVIDIA/nccl
src/init.cc). A model compiled with mode="reduce-overhead" whose graphs hold pynccl collectives
(tensor parallelism's traced all-reduces, say) keeps those graphs in torch's tree manager until
the process ends, so destroy_process_group waited out the group's whole timeout and then failed
(seen on 2xH200, session 21: train_bench's exit hung past 200 s). The graphs cannot replay once
their communicator is gone, so the NCCL backend drops torch.compile's graphs first; a compiled
function called again records new ones.
"""
from __future__ import annotations

import gc
import sys


def drop_compiled_cuda_graphs() -> bool:
    """Free this thread's torch.compile CUDA-graph trees (torch._inductor.cudagraph_trees'
    reset_cudagraph_trees, which torch._dynamo.reset() calls too). Returns whether inductor's
    CUDA-graph trees were loaded at all (nothing to drop otherwise; never imports them)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    trees.reset_cudagraph_trees()
    gc.collect()            # a graph kept alive only by a reference cycle goes now, not at exit
    return True
