"""PipelineStage: one stage's module and its per-micro-batch state (inputs, outputs, gradients),
as torch.distributed.pipelining.PipelineStage. The schedule (schedules.py) decides the order;
the stage runs forward/backward of one micro-batch and hands out the tensors to send.

Stage k lives on pp rank k % pp_size of its group (one stage per rank, or several for
interleaved 1F1B). It counts the micro-batches whose activations it holds (forward done,
backward not yet), so tests can assert 1F1B's memory bound.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ..comm import distributed as dist
from ..comm.groups import resolve_group
from .graphs import StageGraphs
from .p2p import TensorMeta, as_tensor_tuple, container_of, tensor_meta


def _carries_grad(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


# The data-parallel protocol (duck-typed, so the pipeline imports no wrapper; see PipelineStage):
#   no_sync()                       a context whose backwards accumulate gradients locally;
#   prepare_gradient_sync(outputs)  optional, for wrappers that decide in forward whether the next
#                                   backward reduces (pynccl DDP): arm the reduction of `outputs`.
def _is_data_parallel(module: nn.Module) -> bool:
    return callable(getattr(module, "no_sync", None))


def _no_sync(module):
    return module.no_sync() if _is_data_parallel(module) else contextlib.nullcontext()


def _check_dp_wrapper(module: nn.Module):
    """The wrapper's prepare_gradient_sync, or None. torch's DDP decides in forward too, but arms
    itself only through its private reducer and needs torch process groups: refused."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise TypeError("PipelineStage: wrap the stage in pynccl.DistributedDataParallel (over a pynccl dp "
                        "group), not torch.nn.parallel.DistributedDataParallel")
    prepare = getattr(module, "prepare_gradient_sync", None)
    return prepare if _is_data_parallel(module) and callable(prepare) else None


class PipelineStage:
    """PipelineStage(submodule, stage_index, num_stages, device=None, group=None, cuda_graph=False).

    group: the pynccl ProcessGroup of the pipeline axis (pp rank = group rank), None for the
    default group. device: where the stage computes (default: the group's device).
    cuda_graph: capture the module's forward and backward as CUDA graphs and replay them for every
    micro-batch (graphs.py says what a capture fixes, and what it costs in memory: one captured
    pair per micro-batch in flight). CUDA only, not with a data-parallel wrapper.

    Data parallelism: wrap the stage's module in a data-parallel wrapper over the dp group (pynccl's
    DistributedDataParallel, or any module with the protocol below; the stage imports none).
    Micro-batches then accumulate locally (every forward, and every backward but the stage's last
    of the step, run in the wrapper's no_sync()) and the last backward reduces, once per step.
    The protocol: `no_sync()`, a context in whose backwards gradients accumulate locally; and, for
    a wrapper that decides in forward whether the next backward reduces (pynccl DDP, as torch's),
    `prepare_gradient_sync(outputs)`, which the stage calls before the step's last backward to arm
    the reduction of the gradients flowing from `outputs`, as a forward outside no_sync would have.
    A wrapper without it must decide at backward time (a gradient hook reading its no_sync flag).
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device=None, group=None,
                 cuda_graph: bool = False):
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage: submodule must be a torch.nn.Module, got {type(submodule).__name__}")
        for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"PipelineStage: {name} must be an int, got {type(value).__name__}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: need 0 <= stage_index < num_stages, got stage_index="
                             f"{stage_index}, num_stages={num_stages}")
        pp_group = dist.get_default_group() if group is None else resolve_group(group)
        pp_size = pp_group.world_size
        if num_stages % pp_size:
            raise ValueError(f"PipelineStage: num_stages ({num_stages}) must be a multiple of the pipeline "
                             f"group's size ({pp_size}): stage k runs on pp rank k % {pp_size}")
        if stage_index % pp_size != pp_group.group_rank:
            raise ValueError(f"PipelineStage: stage {stage_index} belongs to pp rank {stage_index % pp_size} "
                             f"(stage k runs on rank k % {pp_size}), but this process is pp rank "
                             f"{pp_group.group_rank} of group {pp_group.ranks}")
        self.submodule = submodule
        self._prepare_gradient_sync = _check_dp_wrapper(submodule)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = pp_group
        self.pp_size = pp_size
        self.device = torch.device(device) if device is not None else pp_group.backend.device
        wrong = {str(p.device) for p in submodule.parameters() if p.device.type != self.device.type}
        if wrong:
            raise ValueError(f"PipelineStage: the stage computes on {self.device} but the module has parameters "
                             f"on {', '.join(sorted(wrong))}; move it there first (module.to(device))")
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.graphs = self._make_graphs(cuda_graph)
        # Shapes: of the inputs received (RECV_META) and of the outputs last announced (SEND_META).
        self.inputs_meta: Optional[List[TensorMeta]] = None
        self.outputs_meta_sent: Optional[List[TensorMeta]] = None
        self.num_live_activations = 0
        self.peak_live_activations = 0
        self._returned = None            # the module output's container: None (a tensor), tuple or list
        self._reset_step()

    def _make_graphs(self, cuda_graph: bool):
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"PipelineStage: cuda_graph must be a bool, got {type(cuda_graph).__name__}")
        if not cuda_graph:
            return None
        wrapped = [name or "the stage module" for name, m in self.submodule.named_modules() if _is_data_parallel(m)]
        if wrapped:
            raise TypeError(f"PipelineStage: cuda_graph=True takes the stage's own layers, but {wrapped[0]} is a "
                            f"data-parallel wrapper (it has no_sync(): DDP, ZeRO), whose forward gathers, frees or "
                            f"hooks on the host in ways a graph cannot replay")
        if self.device.type != "cuda":
            raise ValueError(f"PipelineStage: cuda_graph=True needs a CUDA device, but the stage computes on "
                             f"{self.device}")
        return StageGraphs(self.submodule, self.device)

    def __repr__(self):
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages}, pp rank {self.group.group_rank}, {self.device})"

    def _reset_step(self):
        self._fwd_cache: Dict[int, tuple] = {}       # mb -> (inputs, outputs)
        self._received: Dict[int, List[torch.Tensor]] = {}   # mb -> received inputs
        self._output_grads: Dict[int, List[torch.Tensor]] = {}  # mb -> received grads of outputs
        self._input_grads: Dict[int, List[Optional[torch.Tensor]]] = {}  # mb -> grads to send back
        self.outputs: Dict[int, tuple] = {}          # mb -> detached outputs (last stage)
        self.losses: Dict[int, torch.Tensor] = {}
        self.num_live_activations = 0
        self.peak_live_activations = 0
        if self.graphs is not None:
            self.graphs.reset()

    # --- forward -------------------------------------------------------------------------
    def forward_one_chunk(self, mb: int, args: Sequence, kwargs: Optional[dict] = None) -> tuple:
        if self.graphs is not None:
            out = self.graphs(mb, args)
            self._returned = self.graphs.container       # what the module returned when captured
        else:
            with _no_sync(self.submodule):
                returned = self.submodule(*args, **(kwargs or {}))
            out = as_tensor_tuple(returned)
            self._returned = container_of(returned)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        self._fwd_cache[mb] = (inputs, out)
        if self.is_last:
            # A graph's outputs are its static buffers, which the next replay overwrites.
            self.outputs[mb] = tuple(t.detach().clone() if self.graphs is not None else t.detach() for t in out)
        self.num_live_activations += 1
        self.peak_live_activations = max(self.peak_live_activations, self.num_live_activations)
        return out

    def as_returned(self, tensors: Sequence[torch.Tensor]):
        """Output tensors (one micro-batch's, or merged) in the structure the module returned them:
        a bare tensor, or a tuple or list, as torch.distributed.pipelining hands them to loss_fn and
        returns them from step() (a module returning a 1-tuple gets a 1-tuple)."""
        return tensors[0] if self._returned is None else self._returned(tensors)

    def outputs_of(self, mb: int) -> tuple:
        return self._fwd_cache[mb][1]

    def outputs_to_send(self, mb: int) -> List[torch.Tensor]:
        out = self.outputs_of(mb)
        if self.outputs_meta_sent is not None and tensor_meta(out) != self.outputs_meta_sent:
            raise ValueError(f"pipeline stage {self.stage_index}: micro-batch {mb} produced outputs "
                             f"{tensor_meta(out)}, but this step announced {self.outputs_meta_sent}; "
                             f"every micro-batch of a step must have the same shapes")
        return [t.detach().contiguous() for t in out]

    def local_inputs_from(self, prev: "PipelineStage", mb: int) -> List[torch.Tensor]:
        """Inputs handed over by the previous stage on this rank (no message)."""
        return [self._as_input(t.detach()) for t in prev.outputs_of(mb)]

    @staticmethod
    def _as_input(t: torch.Tensor) -> torch.Tensor:
        return t.requires_grad_(True) if _carries_grad(t) else t

    # --- receive buffers -----------------------------------------------------------------
    def input_buffers(self, mb: int) -> List[torch.Tensor]:
        if self.inputs_meta is None:
            raise RuntimeError(f"pipeline stage {self.stage_index}: receive before shapes are known")
        bufs = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in self.inputs_meta]
        self._received[mb] = bufs
        return bufs

    def received_inputs(self, mb: int) -> List[torch.Tensor]:
        # NOTE: called after the recv's Work.wait(); requires_grad is autograd metadata only.
        return [self._as_input(t) for t in self._received.pop(mb)]

    def output_grad_buffers(self, mb: int) -> List[torch.Tensor]:
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=self.device)
                for t in self.outputs_of(mb) if _carries_grad(t)]
        self._output_grads[mb] = bufs
        return bufs

    # --- backward ------------------------------------------------------------------------
    def backward_one_chunk(self, mb: int, loss: Optional[torch.Tensor] = None,
                           output_grads: Optional[List[torch.Tensor]] = None, sync_grads: bool = True) -> None:
        """Backward of micro-batch mb: from `loss` (last stage) or from the gradients of the
        floating-point outputs (received, or given by the next stage on this rank)."""
        inputs, out = self._fwd_cache.pop(mb)
        if self.is_last:
            tensors, grads = [loss], [None]
        else:
            if output_grads is None:
                output_grads = self._output_grads.pop(mb)
            float_out = [t for t in out if _carries_grad(t)]
            pairs = [(t, g) for t, g in zip(float_out, output_grads) if t.requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if sync_grads and self._prepare_gradient_sync is not None:
            # The wrapper decides in forward whether the next backward reduces; all forwards ran in
            # no_sync, so arm it here as a synced forward would (torch.distributed.pipelining does
            # the same with torch DDP's reducer).
            self._prepare_gradient_sync(tensors)
        if tensors:
            with contextlib.nullcontext() if sync_grads else _no_sync(self.submodule):
                torch.autograd.backward(tensors, grad_tensors=grads)
        if not self.is_first:
            # Gradients of the floating-point inputs, zeros where an input did not reach the loss.
            self._input_grads[mb] = [torch.zeros_like(t) if t.grad is None else t.grad.contiguous()
                                     for t in inputs if _carries_grad(t)]
        if self.graphs is not None:
            self.graphs.release(mb)
        self.num_live_activations -= 1

    def _drop_activations(self) -> None:
        """After forwards without backwards (eval()): free what the backwards would have."""
        self._fwd_cache.clear()
        self.num_live_activations = 0

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the .grad of every parameter of the stage module by grad_scale_factor, as torch's
        PipelineStage.scale_grads: the schedules call it after a step's last backward with
        n_microbatches (scale_grads=True), so gradients left from earlier steps are divided too."""
        if grad_scale_factor != 1:
            for p in self.submodule.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def input_grads_to_send(self, mb: int) -> List[torch.Tensor]:
        """What SEND_B sends, or what the previous stage on this rank takes as its output grads."""
        return self._input_grads.pop(mb)
