"""pynccl: NCCL from PyTorch without a framework.

A torch.distributed-like API over two backends ("nccl": a C++ communicator on CUDA
tensors; "gloo": torch's gloo on CPU tensors), and DDP, ZeRO, tensor and pipeline
parallelism written once on top of it.
"""
from ._ext import nccl_version
from .comm import distributed as _distributed
from .comm.backends.base import Work
from .comm.distributed import *  # noqa: F401,F403 - the torch.distributed-like API (comm/distributed.py)
from .errors import CollectiveMismatchError, CommTimeoutError, PacingTimeoutError, PyncclError
from .comm.reduce_op import ReduceOp
from torch.distributed import GroupMember  # new_group / split_group return its NON_GROUP_MEMBER, as torch's

__version__ = "0.1.0"

# Training wrappers load on first use, so `import pynccl` stays cheap.
_LAZY = {
    "DistributedDataParallel": "pynccl.ddp",
    "SyncBatchNorm": "pynccl.ddp",
    "FullyShardedDataParallel": "pynccl.zero",
    "MixedPrecision": "pynccl.zero",
    "clip_grad_norm_": "pynccl.zero",
    "ShardedGradScaler": "pynccl.zero",
    "ParallelMesh": "pynccl.mesh",
}


# `pynccl.comm_hooks` is the name torch users know (torch.distributed.algorithms.ddp_comm_hooks).
_SUBMODULES = {name: f"pynccl.{name}" for name in ("tensor_parallel", "pipeline", "zero", "bench", "testing")}
_SUBMODULES["comm_hooks"] = "pynccl.ddp.hooks"

# NOTE: `from pynccl import *` imports every name here, the lazy ones included (that loads them:
# it is what the star asks for); `import pynccl` alone loads none of them.
__all__ = sorted(set(_distributed.__all__) | {
    "nccl_version", "Work", "CollectiveMismatchError", "CommTimeoutError", "PacingTimeoutError", "PyncclError", "ReduceOp", "GroupMember",
} | set(_LAZY) | set(_SUBMODULES))


def __getattr__(name):
    import importlib
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pynccl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    """The loaded names and the lazy ones (DistributedDataParallel, tensor_parallel, ...), without loading them."""
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
