"""pynccl: NCCL from PyTorch without a framework.

A torch.distributed-like API over two backends ("nccl": a C++ communicator on CUDA
tensors; "gloo": torch's gloo on CPU tensors), and DDP, ZeRO, tensor and pipeline
parallelism written once on top of it.
"""
from ._ext import nccl_version
from .comm.backends.base import P2POp, Work
from .comm.distributed import (ProcessGroup, abort_process_group, flight_record, all_gather, all_gather_into_tensor,
                          all_gather_object, all_reduce, all_to_all, all_to_all_single, barrier, batch_isend_irecv,
                          broadcast, broadcast_object_list, destroy_process_group, gather, get_backend,
                          get_default_group, get_device, get_process_group_ranks, get_rank, get_store,
                          get_world_size, init_process_group, irecv, is_initialized, isend, new_group, recv,
                          reduce, reduce_scatter, reduce_scatter_tensor, scatter, send)
from .errors import CollectiveMismatchError, CommTimeoutError, PyncclError
from .comm.reduce_op import ReduceOp

__version__ = "0.1.0"

# Training wrappers load on first use, so `import pynccl` stays cheap.
_LAZY = {
    "DistributedDataParallel": "pynccl.ddp",
    "SyncBatchNorm": "pynccl.ddp",
    "FullyShardedDataParallel": "pynccl.zero",
    "MixedPrecision": "pynccl.zero",
    "clip_grad_norm_": "pynccl.zero",
    "ParallelMesh": "pynccl.mesh",
}


# `pynccl.comm_hooks` is the name torch users know (torch.distributed.algorithms.ddp_comm_hooks).
_SUBMODULES = {name: f"pynccl.{name}" for name in ("tensor_parallel", "pipeline", "zero", "bench", "testing")}
_SUBMODULES["comm_hooks"] = "pynccl.ddp.hooks"


def __getattr__(name):
    import importlib
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pynccl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
