"""pynccl.DistributedDataParallel: torch DDP's constructor and behaviour, swapped in with one import.

Why it is faster: each bucket's gradients are packed by one fused launch (with a built-in hook,
the 1/world_size scale folded in), reduced by one collective that starts the moment the bucket is full, on the
communicator's stream while backward goes on, and unpacked by one launch at the end of backward,
which only makes the current stream wait (Work.wait(): no host sync). On CUDA the pack runs on a
side stream, so it too overlaps the rest of backward, and with a built-in hook a bucket's pack and
collective are one C++ call (reducer.py). Bucketing and the gradient-ready
hooks are buckets.py (shared with ZeRO); the reduction is a comm hook (hooks.py).
Written once against the Backend interface: the same code runs on gloo (CPU) and nccl (CUDA).

CUDA graphs: a whole step (forward, backward, reduction, optimizer step with capturable=True) can
be captured after a few eager steps (the first builds buckets, the second rebuilds them in
gradient-ready order); buffers are allocated once and nothing on the step's path syncs the host.
Needs find_unused_parameters=False, or static_graph=True (unused parameters are then found in the
first iteration and reused without a host sync). Set grads to None before capture (or zero them
inside the captured region when gradient_as_bucket_view=True).
"""
from __future__ import annotations

import contextlib
from typing import List

import torch
import torch.distributed as tdist
import torch.nn as nn

from ..comm import distributed as dist
from ..comm.coalesced import MiB, broadcast_from_rank0, coalesced_broadcaster
from ..comm.groups import resolve_group
from .join import Join
from .reducer import Reducer
from .sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedDataParallel", "SyncBatchNorm"]


def _resolve_group(process_group, device: torch.device) -> dist.ProcessGroup:
    """process_group: a pynccl group, a torch.distributed group (mapped by resolve_group), or None."""
    if isinstance(process_group, dist.ProcessGroup):
        return process_group
    if not dist.is_initialized():
        if tdist.is_available() and tdist.is_initialized():
            # The script set up torch.distributed only: bootstrap pynccl from it.
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        else:
            raise RuntimeError("DistributedDataParallel: no process group; call pynccl.init_process_group("
                               "backend='nccl'|'gloo') (or torch.distributed.init_process_group) first")
    return dist.get_default_group() if process_group is None else resolve_group(process_group)


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj


class DistributedDataParallel(nn.Module):
    """Data parallelism over a pynccl group; torch.nn.parallel.DistributedDataParallel's arguments.

    Comm hooks see buckets as torch's do, not divided by world size (see hooks.py). `dim` and
    `output_device` are kept for compatibility: single-device modules only, as torch today.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group=None, bucket_cap_mb=25,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        named_params = self._trainable_params(module)
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1:
            raise ValueError(f"DistributedDataParallel: the module's parameters must all be on one device, "
                             f"found {sorted(str(d) for d in devices)}")
        device = devices.pop()
        if device_ids is not None:
            ids = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in device_ids]
            if len(ids) != 1 or ids[0] != device:
                raise ValueError(f"DistributedDataParallel: device_ids must be None or [the module's device "
                                 f"({device})], got {list(device_ids)}")
        group = _resolve_group(process_group, device)
        if device != group.backend.device:
            raise ValueError(f"DistributedDataParallel: the module is on {device} but process group "
                             f"'{group.name}' communicates on {group.backend.device} (backend "
                             f"{group.backend_name!r}); move the module, or use the other backend")

        self.module = module
        self.process_group = group
        self.device = device
        self.device_ids = None if device_ids is None else [device.index if device.type == "cuda" else device]
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        self._check_same_model_on_all_ranks(named_params)
        self._module_buffers = list(module.buffers())
        # NOTE: all of the module's state (parameters and buffers) comes from rank 0, as in torch.
        broadcast_from_rank0(group.backend, [p.detach() for p in module.parameters()] + self._module_buffers)
        self._buffer_broadcast = None
        self._join = None                    # the active join() context (join.py), if any
        self.reducer = Reducer(named_params, group, int(bucket_cap_mb * MiB), find_unused_parameters,
                               gradient_as_bucket_view, static_graph)

    @staticmethod
    def _trainable_params(module: nn.Module) -> List[tuple]:
        # named_parameters() yields a shared (tied) parameter once, under its first name.
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        return named

    def _check_same_model_on_all_ranks(self, named_params):
        signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in named_params]
        everyone = [None] * self.process_group.world_size
        dist.all_gather_object(everyone, signature, group=self.process_group)
        for r, sig in enumerate(everyone):
            if sig != everyone[0]:
                diff = next((a, b) for a, b in zip(sig + [None] * len(everyone[0]), everyone[0] + [None] * len(sig))
                            if a != b)
                raise ValueError(f"DistributedDataParallel: the model differs across ranks: group rank {r} has "
                                 f"{len(sig)} trainable parameters, rank 0 has {len(everyone[0])}; first "
                                 f"difference (rank {r} vs rank 0): {diff[0]} vs {diff[1]}")

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs, **kwargs):
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        sync_buffers = bool(self.broadcast_buffers and self.require_forward_param_sync and self._module_buffers)
        join = self._join
        if join is not None:                 # NOTE: before any other collective of this iteration
            join.notify(sync, sync_buffers)
        if sync:
            self.reducer.prepare_for_forward()
            if join is not None:
                join.after_prepare()
        if sync_buffers:
            self._broadcast_buffers(join.buffer_src if join is not None else 0)
        if self.device_ids is not None:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        output = self.module(*inputs, **kwargs)
        if sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output)
        else:
            self.require_forward_param_sync = False
            self.reducer.bucketer.disarm()
        return output

    def _broadcast_buffers(self, src: int) -> None:
        if self._buffer_broadcast is None:
            self._buffer_broadcast = coalesced_broadcaster(self._module_buffers)
        self._buffer_broadcast(self.process_group.backend, src)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs across ranks (torch's DDP.join): a rank whose loop
        ended takes part, with zero gradients, in the others' collectives until all are done, then
        every rank gets the last joiner's parameters. See join.py."""
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside this context accumulate gradients locally; the
        first synced backward after it reduces the accumulated gradients."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def prepare_gradient_sync(self, outputs) -> None:
        """Arm the next backward, from `outputs`, to reduce, as a forward outside no_sync() would
        have: for a caller whose forwards all ran in no_sync() (pipeline/stage.py's data-parallel
        protocol: micro-batches accumulate locally and the step's last backward reduces)."""
        self.reducer.prepare_for_forward()
        self.reducer.prepare_for_backward(outputs)

    def register_comm_hook(self, state, hook) -> None:
        """hook(state, GradBucket) -> object whose wait() returns the reduced flat gradient;
        torch's semantics: the bucket is not divided by world size, the hook averages (torch's own
        hooks run unchanged; see hooks.py). Once, before training."""
        self.reducer.register_comm_hook(state, hook)
