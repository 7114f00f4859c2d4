"""The "nccl" backend: one pynccl._C.Communicator on CUDA tensors.

The hot path is the C++ method itself: __init__ binds each Communicator method whose signature
matches base.Backend as an instance attribute, so `backend.all_reduce(t, op, async_op)` goes
straight from Python into C++ (op is a ReduceOp int or a PremulSum; C++ reads both).
all_reduce/reduce/broadcast also take output= (last keyword): one out-of-place NCCL call. On the
class the same names are generated forwarders with base.Backend's signatures: they satisfy the
ABC and document the interface, and only a call through the class (NcclBackend.op(b, ...)) runs one.
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
from typing import List, Optional, Union

import torch

from pynccl import _ext
from pynccl.comm.backends.base import Backend
from pynccl.comm.compiled_graphs import drop_compiled_cuda_graphs


@dataclasses.dataclass(frozen=True)
class NcclOptions:
    """ncclConfig_t fields a user may set (-1: NCCL's default)."""

    # NOTE: None = as the environment says, resolved in C++ (_C.timeout_policy), so that a
    # Communicator made directly behaves as init_process_group's. Blocking by default: a
    # non-blocking communicator returns ncclInProgress from every collective, polled to
    # completion: 150-200 us of host time per enqueue on 4 H200s against torch's ~50
    # (RESULTS.md). Blocking calls are bounded by the watchdog instead, which sees each call
    # before it enters NCCL and, past the timeout, ends the process (exit code 75).
    # on_timeout="raise" (PYNCCL_ON_TIMEOUT=raise) aborts and raises CommTimeoutError instead;
    # it needs, and picks, non-blocking communicators. PYNCCL_NCCL_NONBLOCKING=1: non-blocking.
    blocking: Optional[bool] = None
    on_timeout: Optional[str] = None  # "teardown" (default) or "raise"
    name: str = ""                # shows in errors, the flight record file and NCCL's logs
    cga_cluster_size: int = -1
    min_ctas: int = -1
    max_ctas: int = -1
    # ncclConfig_t.CTAPolicy (0 default, 1 efficiency, 2 zero). None: ZERO where the run-time NCCL
    # has copy-engine collectives (>= 2.28), else NCCL's default. ZERO changes only all-gathers
    # (and all-to-all, gather, scatter) whose buffers lie in symmetric windows (comm/symmetric.py):
    # they run on the copy engines, holding no SM. PYNCCL_NCCL_CTA_POLICY overrides it.
    cta_policy: Optional[int] = None


def get_unique_id() -> bytes:
    """A fresh 128-byte ncclUniqueId; rank 0 makes it and shares it through the store."""
    return _ext.require_extension('the "nccl" backend').get_unique_id()


def _device_index(device: Union[int, str, torch.device]) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f'the "nccl" backend needs a CUDA device, got {device}')
    return device.index if device.index is not None else torch.cuda.current_device()


# base.Backend ops that pynccl._C.Communicator implements with the same signature, and the bucket
# kernels, which are module functions of _C.
_COMM_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
             "batch_isend_irecv", "barrier")
_KERNELS = ("pack", "unpack")


def _forwarder(name: str):
    """NcclBackend.<name> on the class: calls the C++ op, with base.Backend's signature."""
    if name in _KERNELS:
        def op(self, *args, **kwargs):
            return getattr(_ext._C, name)(*args, **kwargs)
    else:
        def op(self, *args, **kwargs):
            return getattr(self.comm, name)(*args, **kwargs)
    interface = getattr(Backend, name)
    op.__name__ = name
    op.__qualname__ = f"NcclBackend.{name}"
    op.__doc__ = interface.__doc__
    op.__signature__ = inspect.signature(interface)
    return op


# NOTE: a base class, not methods added after NcclBackend is built: ABCMeta decides which methods
# are still abstract when the class is created.
_CppOps = type("_CppOps", (), {name: _forwarder(name) for name in _COMM_OPS + _KERNELS})


CTA_POLICY_ZERO = 2
_COPY_ENGINE_VERSION = (2, 28, 0)


def _cta_policy(policy: Optional[int]) -> int:
    if policy is not None:
        if policy not in (0, 1, 2):
            raise ValueError(f"NcclOptions.cta_policy must be 0 (default), 1 (efficiency) or 2 (zero), got {policy!r}")
        return policy
    return CTA_POLICY_ZERO if _ext.nccl_version().runtime >= _COPY_ENGINE_VERSION else -1


def _check_cta_limits(min_ctas: int, max_ctas: int) -> None:
    """NcclOptions.min_ctas / max_ctas (<= 0: NCCL's default), checked before NCCL sees them:
    NCCL 2.28 rejects minCTAs without maxCTAs, and a split it rejects that way leaves the parent
    communicator holding freed memory (csrc/comm_config.cpp checks the PYNCCL_NCCL_* overrides)."""
    if min_ctas > 0 and max_ctas <= 0:
        raise ValueError(f"NcclOptions.min_ctas={min_ctas} needs max_ctas as well: NCCL rejects one without the other")
    if min_ctas > 0 and min_ctas > max_ctas:
        raise ValueError(f"NcclOptions.min_ctas={min_ctas} is above max_ctas={max_ctas}")


def _seconds(timeout: Union[float, datetime.timedelta]) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


class NcclBackend(_CppOps, Backend):
    """base.Backend over pynccl._C.Communicator; `comm` is the C++ object for everything else
    (flight_record(), track_sync_ops, get_async_error(), ...)."""

    name = "nccl"

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.device = torch.device("cuda", comm.device)
        # NOTE: hot path. Each op is the bound C++ method, set on the instance so that it shadows
        # the class's forwarder: no Python frame per call.
        for name in _COMM_OPS:
            setattr(self, name, getattr(comm, name))
        for name in _KERNELS:
            setattr(self, name, getattr(_ext._C, name))

    @classmethod
    def create(cls, unique_id: bytes, world_size: int, rank: int, device: Union[int, str, torch.device],
               timeout: Union[float, datetime.timedelta] = 600.0,
               options: Optional[Union[NcclOptions, dict]] = None, **option_fields) -> "NcclBackend":
        """Collective over `world_size` processes: ncclCommInitRankConfig, bounded by `timeout`.
        `options` (or NcclOptions fields as keywords, e.g. name="world") configure the communicator."""
        c = _ext.require_extension('the "nccl" backend')
        if options is None:
            options = NcclOptions()
        elif isinstance(options, dict):
            options = NcclOptions(**options)
        if option_fields:
            options = dataclasses.replace(options, **option_fields)  # TypeError for an unknown field
        _check_cta_limits(options.min_ctas, options.max_ctas)
        comm = c.Communicator(bytes(unique_id), int(world_size), int(rank), _device_index(device),
                              timeout_s=_seconds(timeout), blocking=options.blocking, name=options.name,
                              cga_cluster_size=options.cga_cluster_size, min_ctas=options.min_ctas,
                              max_ctas=options.max_ctas, on_timeout=options.on_timeout,
                              cta_policy=_cta_policy(options.cta_policy))
        return cls(comm)

    def __repr__(self):
        return f"NcclBackend({self.comm!r})"

    # --- timeouts and diagnostics ------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        return self.comm.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: Union[float, datetime.timedelta]):
        self.comm.timeout_s = _seconds(seconds)

    def flight_record(self) -> List[dict]:
        return self.comm.flight_record()

    def check(self):
        """Raise the communicator's stored or asynchronous error, if any."""
        self.comm.check()

    def is_aborted(self) -> bool:
        return self.comm.is_aborted()

    # --- life cycle ------------------------------------------------------------------------
    def split(self, ranks: List[int], timeout, name: str = "") -> Optional["NcclBackend"]:
        """Collective over this communicator (ncclCommSplit): every rank calls it with the same
        `ranks`; the ranks not in it get None. `name` names the new communicator (default:
        "<parent>.split0")."""
        ranks = sorted(int(r) for r in ranks)
        for r in ranks:
            if not 0 <= r < self.world_size:
                raise ValueError(f"split: rank {r} is out of range for a group of world_size {self.world_size}")
        color, key = (0, ranks.index(self.rank)) if self.rank in ranks else (-1, 0)
        child = self.comm.split(color, key, _seconds(timeout), name)
        return None if child is None else NcclBackend(child)

    def duplicate(self, timeout, name: str) -> "NcclBackend":
        """ncclCommSplit of every rank into one new communicator (collective over this one)."""
        return self.split(list(range(self.world_size)), timeout, name)

    def destroy(self):
        """Collective: ncclCommFinalize then ncclCommDestroy, bounded by the timeout (a blocking
        finalize by the watchdog: past it, the process ends as on any time-out). Returns at once
        on an aborted communicator. torch.compile's CUDA graphs go first (compiled_graphs.py):
        NCCL waits for every graph that captured the communicator's collectives."""
        drop_compiled_cuda_graphs()
        self.comm.destroy()

    def abort(self):
        """Local: ncclCommAbort; later ops raise PyncclError. torch.compile's CUDA graphs go first,
        as in destroy()."""
        drop_compiled_cuda_graphs()
        self.comm.abort()
