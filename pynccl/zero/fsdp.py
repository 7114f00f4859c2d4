"""FullyShardedDataParallel: ZeRO stages 1-3 behind one nn.Module wrapper, used with a plain
torch optimizer and an ordinary training loop:

    model = pynccl.FullyShardedDataParallel(net, stage=3, mixed_precision=MixedPrecision(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # state for this rank's shards only
    loss = loss_fn(model(x), y); loss.backward(); model.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

What users see:
  * `named_parameters()` / `parameters()` are the module's own nn.Parameter objects, under
    their own names (with the wrapper's `module.` prefix) and with their original number of
    dimensions: each holds this rank's rows of that parameter (dim-0 row ranges of the unit's
    flat shard, layout.py; empty (0, ...) on ranks that hold none of it), the flat buffers stay
    what communication runs on. So param groups built from names and p.dim() (nanoGPT's
    configure_optimizers, "no decay on biases and norms") work unchanged, before or after
    wrapping, and element-wise optimizers (SGD with or without momentum, Adam, AdamW, Adamax,
    NAdam, RAdam, Adagrad, RMSprop, Adadelta, ASGD; for-loop, foreach or fused) are exact.
    Optimizers that look at a whole tensor (LAMB and LARS trust ratios, Adafactor's factored
    moments, Shampoo/SOAP/Muon, LBFGS) see row shards and are NOT exact.
  * Inside forward the module reads full tensors (gathered, compute dtype) under the same
    attribute names, so its code runs unchanged; its buffers stay as they are. A call of
    model.module itself (an eval loop, Hugging Face model.generate / model.module.generate) is
    a forward too, as with FSDP2's root module (root_calls.py): on every rank alike.
    requires_grad=False parameters are kept whole on every rank (not sharded).
    `model.module.state_dict()` holds the row shards; `model.state_dict()` DTensors (FSDP2's
    form, for torch.distributed.checkpoint: dcp.py), `full_state_dict()` the full tensors.
  * Stages 1/2 all-gather the updated shards at the first forward after a backward that
    reduced gradients, after any torch.optim step of an optimizer holding these parameters,
    and after a load (stage12.py); never by watching version counters, which fused optimizers
    do not bump. Between optimizer.step() and that forward model.module's full tensors are
    stale; full_state_dict() is always current.
  * Stages 1/2 need every trainable parameter in every loss (as DDP without
    find_unused_parameters); stage 3 gives unused ones, and units that did not run, a zero
    gradient (AdamW's weight decay still moves them, as in torch FSDP).
  * Gradients are averaged over the group (ReduceOp.AVG), in MixedPrecision.reduce_dtype.
  * Hybrid sharding (torch FSDP's HYBRID_SHARD, FSDP2's 2-D mesh): process_group=(shard_group,
    replicate_group), mesh=ParallelMesh(dp_shard=...) or a 2-D torch DeviceMesh (replicate, shard).
    Everything is sharded within the shard group (a node); gradients are reduce-scattered there,
    then averaged across the replicate group, so they are the mean over every rank. Checkpoints
    hold one replica's shards (the first replica writes them, every replica loads them).
  * Global-norm clipping: model.clip_grad_norm_(max_norm) or
    pynccl.clip_grad_norm_(model.parameters(), max_norm), which knows which tensors are shards
    (torch.nn.utils.clip_grad_norm_ would compute a local norm on each rank).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
from torch import nn

from ..comm.coalesced import MiB, broadcast_from_rank0
from ..comm.distributed import ProcessGroup
from . import checkpoint, clip
from . import state_dict_type as _sd_type
from .hybrid import broadcast_to_replicas, resolve_dp_groups
from . import state_dict as _state_dict
from .memory import held_bytes
from .mixed_precision import MixedPrecision, cast_inputs, cast_outputs, check_policy
from .params import collect_params, install, named_buffers_all
from .root_calls import RootCallHooks
from .sharding_strategy import resolve_stage
from .stage3 import ShardedParamsRuntime
from .stage12 import ReplicatedParamsRuntime
from .wrap import WrapSpec, select_unit_modules


class FullyShardedDataParallel(nn.Module):
    """ZeRO-sharded data parallelism; see the module docstring.

    stage: 1 (optimizer state sharded), 2 (+ gradients reduce-scattered in buckets during
    backward), 3 (+ parameters sharded, gathered per unit; the default, as torch FSDP's
    FULL_SHARD). sharding_strategy (keyword): torch's ShardingStrategy instead of stage
    (sharding_strategy.py: FULL_SHARD 3, SHARD_GRAD_OP 2). process_group: a pynccl group
    (default: the default group). mixed_precision: pynccl's MixedPrecision, or torch's
    MixedPrecisionPolicy (FSDP2) / MixedPrecision (FSDP1), mapped field by field.
    bucket_cap_mb: gradient bucket size of stages 1/2.
    wrap_modules (stage 3): None/"auto", module classes, submodules, or a predicate.
    sync_module_states: start from rank 0's parameters and buffers.
    process_group=(shard_group, replicate_group) or mesh= (a ParallelMesh with dp_shard, or a
    torch DeviceMesh of dims (replicate, shard)): hybrid sharding (hybrid.py).
    """

    _pynccl_zero_model = True    # how dcp.py and tensor_parallel/dcp.py recognise it without importing this file

    def __init__(self, module: nn.Module, stage: Optional[int] = None, process_group: Optional[ProcessGroup] = None,
                 mixed_precision: Optional[MixedPrecision] = None, bucket_cap_mb: float = 25,
                 wrap_modules: WrapSpec = None, sync_module_states: bool = True, mesh=None, *,
                 sharding_strategy=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("FullyShardedDataParallel: the module is already wrapped; nesting is not supported")
        stage, hybrid = resolve_stage(stage, sharding_strategy)
        if hybrid and mesh is None and not isinstance(process_group, (tuple, list)):
            from ..mesh import ParallelMesh             # torch FSDP's HYBRID_SHARD default: a shard group per node
            if process_group is not None:
                raise ValueError(f"FullyShardedDataParallel: {sharding_strategy} needs process_group=(shard_group, "
                                 f"replicate_group), mesh=, or neither (one shard group per node); got one group")
            mesh = ParallelMesh(dp=None, dp_shard="node")
        if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or bucket_cap_mb <= 0:
            raise ValueError(f"FullyShardedDataParallel: bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        if wrap_modules is not None and stage != 3:
            raise ValueError(f"FullyShardedDataParallel: wrap_modules only applies to stage 3, got stage={stage}")
        self.policy = check_policy(mixed_precision)
        # pynccl or torch.distributed groups (resolve_group maps a torch one); TypeError otherwise.
        # process_group is the shard group: what state_dict.py and checkpoint.py gather over.
        self.process_group, self.replicate_group = resolve_dp_groups(process_group, mesh)
        self.stage = stage
        self.device = self.process_group.backend.device
        module.to(self.device)
        self.module = module
        self._sync_grads = True

        unit_modules = select_unit_modules(module, wrap_modules) if stage == 3 else []
        self._param_infos, tensors = collect_params(module)
        if not any(i.requires_grad for i in self._param_infos):
            raise ValueError("FullyShardedDataParallel: the module has no parameter that requires grad")
        self._keep_frozen(tensors, sync_module_states)
        if sync_module_states:
            buffers = [buf for _, buf in named_buffers_all(module)]
            if self.process_group.world_size > 1:
                broadcast_from_rank0(self.process_group.backend, buffers)
            broadcast_to_replicas(self.replicate_group, buffers)
        if stage == 3:
            self._runtime = ShardedParamsRuntime(unit_modules, self._param_infos, tensors, self.process_group,
                                                 self.policy, sync_module_states, self.replicate_group)
        else:
            self._runtime = ReplicatedParamsRuntime(stage, self._param_infos, tensors, self.process_group,
                                                    self.policy, int(bucket_cap_mb * MiB), sync_module_states,
                                                    self.replicate_group)
        del tensors
        self._root_calls = RootCallHooks(self)     # model.module(...) / generate outside forward (root_calls.py)

    def _keep_frozen(self, tensors: List[torch.Tensor], sync: bool) -> None:
        """requires_grad=False parameters stay whole on every rank, cast to the compute dtype."""
        frozen = [(info, t.detach()) for info, t in zip(self._param_infos, tensors) if not info.requires_grad]
        if sync and self.process_group.world_size > 1:
            broadcast_from_rank0(self.process_group.backend, [master for _, master in frozen])
        if sync:
            broadcast_to_replicas(self.replicate_group, [master for _, master in frozen])
        for info, master in frozen:
            info.frozen_master = master
            dtype = self.policy.param_dtype
            install(info, master.to(dtype) if dtype is not None and master.is_floating_point() else master)

    @property
    def units(self):
        """The sharded units (flat layouts, shards, buffers), in parameters() order."""
        return self._runtime.units

    # ------------------------------------------------------------------ training
    def forward(self, *args, **kwargs):
        args, kwargs = cast_inputs(self.policy, args, kwargs)
        rt = self._runtime
        self._pre_forward()
        if self.stage != 3:
            return cast_outputs(self.policy, self.module(*args, **kwargs))
        with torch.autograd.graph.saved_tensors_hooks(rt.pack, rt.unpack):
            out = self.module(*args, **kwargs)
        rt.post_root_forward(out)
        return cast_outputs(self.policy, out)

    @torch._disable_dynamo                             # never traced by torch.compile (collectives)
    def _pre_forward(self, wrapper_call: bool = True) -> None:
        if torch.is_grad_enabled():
            self._check_requires_grad()
        if self.stage != 3:
            self._runtime.pre_forward(self._sync_grads)
        else:
            self._runtime.pre_root_forward(self._sync_grads)
        # NOTE: last, right before forward calls the module: its hooks then leave that call to forward.
        self._root_calls.wrapper_call_next = wrapper_call

    def generate(self, *args, **kwargs):
        """The wrapped module's generate() (Hugging Face GenerationMixin), as FSDP2's model.generate: each
        forward call inside it gathers what it needs and releases it after (root_calls.py). Collective:
        call it on every rank with the same inputs (and the same seed when sampling), so that every rank
        makes as many forward calls; model.module.generate(...) is the same."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise AttributeError(f"FullyShardedDataParallel.generate: the wrapped {type(self.module).__name__} has "
                                 f"no generate() (Hugging Face models have it through GenerationMixin)")
        return generate(*args, **kwargs)

    def _check_requires_grad(self) -> None:
        """Which parameters train is fixed at wrapping (shards, buckets and units are built from it, as
        torch FSDP's with use_orig_params=False): a later requires_grad_ would be silently ignored."""
        for info in self._param_infos:
            if info.param.requires_grad != info.requires_grad:
                raise RuntimeError(
                    f"FullyShardedDataParallel: parameter '{info.name}' had requires_grad={info.requires_grad} "
                    f"when it was wrapped and now has requires_grad={info.param.requires_grad}; changing it after "
                    f"wrapping is not supported. Set requires_grad before wrapping (and wrap again to change it), "
                    f"or, to stop training a parameter, leave it out of the optimizer's param groups.")

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: backward passes of forwards run inside
        this context keep their gradients unreduced (full size, compute dtype); the first
        backward outside it reduces the sum into the shards."""
        previous, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that the norm over all ranks' shards is at most max_norm;
        returns that total norm (as torch.nn.utils.clip_grad_norm_ does). Collective."""
        return clip.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """Original names -> full tensors (master dtype, CPU): loads into the unwrapped model. Collective."""
        return _state_dict.full_state_dict(self, rank0_only)

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = False) -> dict:
        """torch.optim state dict keyed by the original module.parameters() positions. Collective."""
        return _state_dict.full_optim_state_dict(self, optimizer, rank0_only)

    def load_full_state_dict(self, state_dict: Optional[dict] = None, optim_state_dict: Optional[dict] = None,
                             optimizer: Optional[torch.optim.Optimizer] = None, strict: bool = True) -> None:
        """Load full (consolidated or plain-model) state dicts, at any world size and stage."""
        _state_dict.load_full_state_dict(self, state_dict, optim_state_dict, optimizer, strict)

    def save_sharded(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Each rank writes its shards (and optimizer state) atomically under directory `path`."""
        checkpoint.save_sharded(self, path, optimizer)

    def load_sharded(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Load save_sharded's files; from another world size or stage, reshard through full state."""
        checkpoint.load_sharded(self, path, optimizer)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Collective. By default sharded, as FSDP2's: {original name: DTensor Shard(0)} for
        torch.distributed.checkpoint (dcp.py); full CPU tensors after
        set_state_dict_type(model, StateDictType.FULL_STATE_DICT) (torch FSDP1's default)."""
        sd = _sd_type.module_state_dict(self)
        if destination is None:
            return type(sd)((prefix + k, v) for k, v in sd.items())
        for k, v in sd.items():
            destination[prefix + k] = v
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Full tensors (any plain or consolidated state dict) or DTensors (state_dict()'s, FSDP2's,
        filled by dcp.load at any world size or stage). Collective when sharded."""
        return _state_dict.load_model_state_dict(self, state_dict, strict)

    # torch FSDP1's state-dict API (static, as there): state_dict_type.py
    set_state_dict_type = staticmethod(_sd_type.set_state_dict_type)
    state_dict_type = staticmethod(_sd_type.state_dict_type)
    optim_state_dict = staticmethod(_sd_type.optim_state_dict)
    optim_state_dict_to_load = staticmethod(_sd_type.optim_state_dict_to_load)

    # ------------------------------------------------------------------ introspection
    def memory_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
        """Bytes this rank holds now in parameters, gradients and optimizer state, counted
        from the distinct tensor storages (what ZeRO's memory formulas count); see memory.py."""
        return held_bytes(self, optimizer)
