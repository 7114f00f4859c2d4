"""CUDA graphs that torch.compile keeps (mode="reduce-overhead": inductor's CUDA-graph trees) and
a communicator's end.

NCCL does not finish destroying or aborting a communicator while a CUDA graph that captured one of
its collectives is alive (commDestroySync polls until no graph references it; NVIDIA/nccl
src/init.cc). A model compiled with mode="reduce-overhead" whose graphs hold pynccl collectives
(tensor parallelism's traced all-reduces, say) keeps those graphs in torch's tree manager until
the process ends, so destroy_process_group waited out the group's whole timeout and then failed
(seen on 2xH200, session 21: train_bench's exit hung past 200 s). So the NCCL backend drops the
graphs first, through torch._dynamo.reset(): it resets the trees and forgets every compiled frame,
so a compiled function called again compiles and records anew. (Resetting the trees alone left
each compiled function holding the shut-down tree manager: its next call raised "Running CUDAGraph
after shutdown", torch 2.11.) That costs a recompile of what this thread compiled, and only where
this thread holds CUDA-graph trees; the trees are per thread (torch's), so graphs recorded by
another thread are not seen and are waited for as before.
"""
from __future__ import annotations

import gc
import sys

import torch


def _holds_trees(trees) -> bool:
    """Whether this thread has a CUDA-graph tree manager (torch's thread-local containers)."""
    try:
        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return False
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        return any(getattr(c, "tree_manager", None) is not None for c in containers.values())
    except Exception:     # torch's private layout moved: drop them, as if there were some
        return True


def drop_compiled_cuda_graphs() -> bool:
    """Free this thread's torch.compile CUDA-graph trees, where it holds any (torch._dynamo.reset(),
    which resets inductor's trees too, then a collection). Returns whether it did; never imports
    inductor (not loaded: nothing was recorded)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not _holds_trees(trees):
        return False
    import torch._dynamo
    torch._dynamo.reset()
    gc.collect()            # a graph kept alive only by a reference cycle goes now, not at exit
    return True
