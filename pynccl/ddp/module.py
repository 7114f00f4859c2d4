"""pynccl.DistributedDataParallel: torch DDP's constructor and behaviour, swapped in with one import.

Why it is faster: each bucket's gradients are packed by one fused launch (with a built-in hook,
the 1/world_size scale folded in), reduced by one collective that starts the moment the bucket is full, on the
communicator's stream while backward goes on, and unpacked by one launch at the end of backward,
which only makes the current stream wait (Work.wait(): no host sync); or, with
`reducer.unpack_early` (issue 26, off by default), by the same launch on a side stream as soon as
the bucket's all-reduce ends (reducer._unpacks_early says where that is exact). On CUDA the pack runs on a
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
import types
from typing import List, Optional

import torch
import torch.distributed as tdist
import torch.nn as nn

from ..comm import distributed as dist
from ..comm.coalesced import MiB, broadcast_from_rank0, coalesced_broadcaster
from ..comm.groups import resolve_group
from . import comm_path as comm_paths
from . import defaults
from . import hooks as comm_hooks
from .embedding_rows import TiedEmbeddingRows
from .join import Join
from .optimizer_overlap import OptimizerOverlap
from .reducer import Reducer
from .sync_batchnorm import SyncBatchNorm
from .torch_args import group_or_mesh, refuse_unsupported, sync_plan

__all__ = ["DistributedDataParallel", "SyncBatchNorm"]

_NO_WINDOW = contextlib.nullcontext()      # forward without tied_embedding_rows (reusable, allocated once)
_TORCH_FIRST_BUCKET_BYTES = getattr(tdist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 * MiB)


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


@contextlib.contextmanager
def _as_active_ddp_module(ddp: "DistributedDataParallel"):
    """While the wrapped module runs, torch.compile's DDPOptimizer (torch._dynamo.config.optimize_ddp,
    on by default) takes this wrapper for the active torch DDP module, as torch DDP's forward marks
    itself: graphs compiled inside are split where a bucket's worth of parameters
    (ddp.bucket_bytes_cap) ends, so the compiled backward hands gradients out piece by piece and
    their buckets reduce while it goes on. Unsplit, a compiled module's gradients all come out at
    the end of its backward, and no reduction overlaps it."""
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    # NOTE: DDPOptimizer asserts that its first bucket (torch's 1 MiB) fits in bucket_bytes_cap.
    if not hasattr(torch_ddp, "_active_ddp_module") or ddp.bucket_bytes_cap < _TORCH_FIRST_BUCKET_BYTES:
        yield
        return
    previous = torch_ddp._active_ddp_module
    torch_ddp._active_ddp_module = ddp
    try:
        yield
    finally:
        torch_ddp._active_ddp_module = previous


def _refuse_sparse_gradients(module: nn.Module, named_params) -> None:
    """Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True, as torch finds them) are
    not supported: the buckets are flat dense buffers. Said here, not deep inside backward."""
    reduced = {id(p): n for n, p in named_params}
    for m in module.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and id(m.weight) in reduced:
            raise ValueError(f"DistributedDataParallel: parameter '{reduced[id(m.weight)]}' gets sparse gradients "
                             f"({type(m).__name__}(sparse=True)), which pynccl's DDP does not support; use "
                             "sparse=False, or torch.nn.parallel.DistributedDataParallel for this model")


class DistributedDataParallel(nn.Module):
    """Data parallelism over a pynccl group; torch.nn.parallel.DistributedDataParallel's arguments, in
    its positional order (torch 2.14's): those beyond pynccl's own core are mapped or refused in
    torch_args.py (init_sync, forward_sync_buffers and device_mesh act as in torch).

    Comm hooks see buckets as torch's do, not divided by world size (see hooks.py). `dim` and
    `output_device` are kept for compatibility: single-device modules only, as torch today.
    comm_path (pynccl's own, keyword only): how the buckets are all-reduced on NCCL: "auto"
    (default; PYNCCL_DDP_COMM_PATH overrides), "default", "symmetric", "copy_engine" or "copy_engine_a2a"
    (comm_path.py); `reducer.comm_path` says what is in use and why.
    gradient_as_bucket_view: None (default) is True, measured faster (defaults.py): each .grad is
    its bucket's view, the same tensor every step, as in torch with the flag; False is torch's
    default behaviour.
    tied_embedding_rows (pynccl's own, keyword only): an LM head tied to an embedding has its part
    of the gradient all-reduced first and the rest exchanged as rows (embedding_rows.py);
    None (default): on for models that have one (PYNCCL_DDP_TIED_EMBEDDING_ROWS=0|1 overrides),
    stepping aside where a feature needs the plain path (defaults.py); True: on, and such
    features raise; False: off.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: Optional[bool] = None, init_sync: bool = True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: Optional[bool] = None, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                 device_mesh=None, skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list=None,
                 batched_grad_copy: bool = False, forward_sync_buffers: Optional[bool] = None, *,
                 comm_path: Optional[str] = None, tied_embedding_rows: Optional[bool] = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
        refuse_unsupported(check_reduction, delay_all_reduce_named_params=delay_all_reduce_named_params,
                           param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                           skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                           bucket_cap_mb_list=bucket_cap_mb_list)
        plan = sync_plan(broadcast_buffers, init_sync, forward_sync_buffers)
        process_group = group_or_mesh(process_group, device_mesh)
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        # torch's list of what DDP leaves alone (_set_params_and_buffers_to_ignore_for_model): names
        # as named_parameters / named_buffers give them.
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named_params = self._trainable_params(module, ignored)
        _refuse_sparse_gradients(module, named_params)
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
        self.broadcast_buffers = plan.forward_buffers      # torch 2.14: also forward_sync_buffers (below)
        self.batched_grad_copy = batched_grad_copy         # torch_args.py: no effect here
        self.find_unused_parameters = find_unused_parameters
        gradient_as_bucket_view = defaults.gradient_as_bucket_view(gradient_as_bucket_view)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_bytes_cap = int(bucket_cap_mb * MiB)     # torch DDP's name (torch.compile reads it)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

        if plan.init:
            self._check_same_model_on_all_ranks(named_params)
        self._module_buffers = [b for n, b in module.named_buffers() if n not in ignored]
        # NOTE: the module's state comes from rank 0, as in torch, but for what it ignores: each rank keeps
        # its own; and as torch_args.sync_plan says (broadcast_buffers=False leaves the buffers rank-local
        # from the start, e.g. BatchNorm statistics; init_sync=False syncs nothing).
        synced = [p.detach() for n, p in module.named_parameters() if n not in ignored] if plan.init else []
        broadcast_from_rank0(group.backend, synced + (self._module_buffers if plan.init_buffers else []))
        self._buffer_broadcast = None
        self._join = None                    # the active join() context (join.py), if any
        self.reducer = Reducer(named_params, group, self.bucket_bytes_cap, find_unused_parameters,
                               gradient_as_bucket_view, static_graph, comm_paths.resolve(comm_path))
        heads, explicit = defaults.tied_embedding_rows(tied_embedding_rows, module)
        reduced = {id(p) for _, p in named_params}
        heads = [(h, es) for h, es in heads if id(h.weight) in reduced]     # an ignored tied weight: left alone
        if heads or explicit:               # explicit and none found: TiedEmbeddingRows raises
            self.reducer.tied_rows = TiedEmbeddingRows(self, heads, explicit)

    def _tied_rows_refuse_or_drop(self, what: str, why: str, error=RuntimeError) -> None:
        """`what` needs the plain path for the tied weight: asked for outright, refuse; turned on by
        the environment, step aside (defaults.py)."""
        rows = self.reducer.tied_rows
        if rows is None:
            return
        if rows.explicit:
            raise error(f"{what}: not supported with tied_embedding_rows=True ({why})")
        rows.remove()

    @staticmethod
    def _trainable_params(module: nn.Module, ignored=frozenset()) -> List[tuple]:
        """(name, parameter) of what DDP reduces, as torch's _build_params_for_reducer picks them: each
        module's own parameters that require grad, under "<module name>.<name>", not in `ignored`,
        a shared (tied) one once, under its first such name."""
        if not any(p.requires_grad for n, p in module.named_parameters() if n not in ignored):
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                               "parameter that requires a gradient.")
        named, seen = [], set()
        for module_name, m in module.named_modules():
            for name, p in m.named_parameters(recurse=False):
                # NOTE: torch's very names: the root module's own parameters are ".name" there, so
                # listing "name" does not take them out of the reduction (only out of the broadcast).
                full = f"{module_name}.{name}"
                if p.requires_grad and full not in ignored and id(p) not in seen:
                    seen.add(id(p))
                    named.append((full[1:] if not module_name else full, p))
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
        # NOTE: traced by torch.compile(ddp), the bookkeeping around the module's own code
        # (collectives, the walk of the autograd graph for unused parameters) broke the graph at
        # every step of it (14 breaks, 7 graphs for an HF Llama): there it runs eagerly, one break
        # before the module and one after. Eager callers skip the ~10 us that costs.
        run = _UNTRACED if torch.compiler.is_compiling() else _PLAIN
        inputs, kwargs, sync = run.pre_forward(self, inputs, kwargs)
        # tied_embedding_rows: heads read the alias only here (and never traced: off under compile)
        tied = self.reducer.tied_rows if run is _PLAIN else None
        with run.active_ddp_module(self), (tied.forward_window(sync) if tied is not None else _NO_WINDOW):
            output = self.module(*inputs, **kwargs)
        return run.post_forward(self, output, sync)

    def _pre_forward(self, inputs, kwargs):
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
        return inputs, kwargs, sync

    def _post_forward(self, output, sync: bool):
        if sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output)
            self.reducer.bucketer.watch_outputs(output)
        else:
            self.require_forward_param_sync = False
            self.reducer.bucketer.disarm()
        return output

    @property
    def forward_sync_buffers(self) -> bool:
        """torch 2.14's name for broadcast_buffers: rank 0's buffers broadcast before each forward."""
        return self.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.broadcast_buffers = value

    def _broadcast_buffers(self, src: int) -> None:
        if self._buffer_broadcast is None:
            self._buffer_broadcast = coalesced_broadcaster(self._module_buffers)
        self._buffer_broadcast(self.process_group.backend, src)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs across ranks (torch's DDP.join): a rank whose loop
        ended takes part, with zero gradients, in the others' collectives until all are done, then
        every rank gets the last joiner's parameters. See join.py."""
        if enable:
            self._tied_rows_refuse_or_drop("DistributedDataParallel.join", "a joined rank would not take part in "
                                           "the embedding rows' exchange")
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

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """pynccl's own (torch's counterpart is the experimental _register_fused_optim): steps
        `optimizer`'s parameters a bucket at a time during backward, as each bucket's reduction
        ends (optimizer_overlap.py). Returns the same optimizer; its step() then only waits.
        Exact for torch's optimizers; refuses find_unused_parameters=True."""
        if self.reducer.overlap is not None:
            raise RuntimeError("overlap_optimizer: an optimizer is already overlapped with this model's backward")
        self._tied_rows_refuse_or_drop("overlap_optimizer", "the tied weight's bucket would be stepped before its "
                                       "embedding rows arrive, at the end of backward")
        self.reducer.overlap = OptimizerOverlap(self.reducer, optimizer)
        return optimizer

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
        if self.reducer.tied_rows is not None and (hook not in comm_hooks.BUILTIN_HOOKS or
                                                   resolve_group(state) is not self.process_group):
            self._tied_rows_refuse_or_drop("register_comm_hook", "only pynccl's built-in hooks over the DDP group "
                                           "itself (state None or that group) are supported: the embedding rows are "
                                           "averaged over that group, as the built-in hooks average the buckets",
                                           error=ValueError)
        self.reducer.register_comm_hook(state, hook)


# forward's steps, as called eagerly and as called from code torch.compile traces (run eagerly
# there too: torch._disable_dynamo; recursive=False lets dynamo compile the module run inside).
_PLAIN = types.SimpleNamespace(pre_forward=DistributedDataParallel._pre_forward,
                               post_forward=DistributedDataParallel._post_forward,
                               active_ddp_module=_as_active_ddp_module)
_UNTRACED = types.SimpleNamespace(pre_forward=torch._disable_dynamo(DistributedDataParallel._pre_forward),
                                  post_forward=torch._disable_dynamo(DistributedDataParallel._post_forward),
                                  active_ddp_module=contextlib.contextmanager(
                                      torch._disable_dynamo(_as_active_ddp_module.__wrapped__, recursive=False)))
