"""pynccl: NCCL from PyTorch without a framework.

A torch.distributed-like API over two backends ("nccl": a C++ communicator on CUDA
tensors; "gloo": torch's gloo on CPU tensors), and DDP, ZeRO, tensor and pipeline
parallelism written once on top of it.
"""
from ._ext import nccl_version
from .backends.base import P2POp, Work
from .distributed import (ProcessGroup, abort_process_group, flight_record, all_gather, all_gather_into_tensor,
                          all_gather_object, all_reduce, all_to_all, all_to_all_single, barrier, batch_isend_irecv,
                          broadcast, broadcast_object_list, destroy_process_group, gather, get_backend,
                          get_default_group, get_device, get_process_group_ranks, get_rank, get_store,
                          get_world_size, init_process_group, irecv, is_initialized, isend, new_group, recv,
                          reduce, reduce_scatter, reduce_scatter_tensor, scatter, send)
from .errors import CollectiveMismatchError, CommTimeoutError, PyncclError
from .reduce_op import ReduceOp

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


_SUBMODULES = ("tensor_parallel", "pipeline", "zero", "bench", "comm_hooks", "testing")


def __getattr__(name):
    import importlib
    if name in _SUBMODULES:
        return importlib.import_module(f"pynccl.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pynccl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
