"""ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B: torch.distributed.pipelining's API
over pynccl's grouped point-to-point.

Each schedule runs, instruction by instruction, the program that actions.build_programs makes
for its rank, the same lists schedule_checker proves deadlock-free. A batch of sends/recvs is
one batch_isend_irecv; a batch with receives is waited on before the next compute (a stream
wait on NCCL, no host block); send-only batches are waited on at the end of the step.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .actions import Action, ActionType, Instruction, PipelineLayout, ScheduleKind, build_program
from .p2p import PipeTransport, tensor_meta
from .stage import PipelineStage

A = ActionType


def split_microbatches(what: str, values: Sequence, n: int) -> List[list]:
    """Chunk each tensor along dim 0 into n equal micro-batches, tensors inside tuples, lists and
    dicts too (torch.distributed.pipelining's default chunk spec); other values are replicated."""
    leaves, spec = tree_flatten(list(values))
    chunks = []
    for v in leaves:
        if isinstance(v, torch.Tensor):
            if v.dim() == 0 or v.shape[0] % n:
                raise ValueError(f"pipeline step: a tensor of {what} has shape {tuple(v.shape)}; its batch dimension "
                                 f"(dim 0) must divide evenly into n_microbatches={n}")
            chunks.append(list(v.chunk(n)))
        else:
            chunks.append([v] * n)
    return [tree_unflatten([c[j] for c in chunks], spec) for j in range(n)]


def _default_specs_only(cls, args_chunk_spec, kwargs_chunk_spec, output_merge_spec) -> None:
    """The schedules take torch.distributed.pipelining's arguments in its order, so a call written for
    torch means the same here; of its chunk specs only the default (None) is supported."""
    given = [name for name, v in (("args_chunk_spec", args_chunk_spec), ("kwargs_chunk_spec", kwargs_chunk_spec),
                                  ("output_merge_spec", output_merge_spec)) if v is not None]
    if given:
        raise ValueError(f"{cls.__name__}: {', '.join(given)} not supported: inputs and target are split along dim "
                         f"0 and the last stage's outputs concatenated along dim 0 (torch's default, None)")


class _PipelineSchedule:
    """Runs one rank's program (actions.build_programs) for its stages.

    Building a schedule is collective over the pipeline group: on NCCL every rank connects to its
    neighbours then (p2p.PipeTransport), so every rank of the group must build its schedule."""
    kind: ScheduleKind

    def __init__(self, stages: List[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable],
                 scale_grads: bool):
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
            raise ValueError(f"{type(self).__name__}: n_microbatches must be a positive int, got {n_microbatches!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{type(self).__name__}: loss_fn must be callable (output, target) -> loss, or None "
                            f"(forward only), got {type(loss_fn).__name__}")
        for s in stages:
            if not isinstance(s, PipelineStage):
                raise TypeError(f"{type(self).__name__}: expected PipelineStage, got {type(s).__name__}")
        group = stages[0].group
        if any(s.group is not group for s in stages):
            raise ValueError(f"{type(self).__name__}: all stages of a rank must share one pipeline group")
        pp_size, pp_rank = group.world_size, group.group_rank
        v = len(stages)
        if any(s.num_stages != pp_size * v for s in stages):
            raise ValueError(f"{type(self).__name__}: {v} stage(s) per rank × pp size {pp_size} = {pp_size * v}, "
                             f"but the stages say num_stages={stages[0].num_stages}")
        layout = PipelineLayout(pp_size, v)
        expected = layout.stages_of(pp_rank)
        got = sorted(s.stage_index for s in stages)
        if got != expected:
            raise ValueError(f"{type(self).__name__}: pp rank {pp_rank} must hold stages {expected}, got {got}")
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = bool(scale_grads)
        # As torch.distributed.pipelining: without a loss_fn, step() runs forwards only (as eval()).
        self._has_backward = loss_fn is not None
        self.layout = layout
        self.pp_rank = pp_rank
        self._stages: Dict[int, PipelineStage] = {s.stage_index: s for s in stages}
        self._transport = PipeTransport(group, stages[0].device)
        # Single source of truth: the programs the checker simulates (the second for eval() and loss_fn=None).
        self.program: List[Instruction] = build_program(self.kind, pp_rank, pp_size, n_microbatches, v)
        self.forward_program: List[Instruction] = build_program(self.kind, pp_rank, pp_size, n_microbatches, v,
                                                                forward_only=True)
        self._last_backward = {}       # stage -> its last backward's micro-batch (that one reduces)
        for instr in self.program:
            if instr[0].type is A.BACKWARD:
                self._last_backward[instr[0].stage] = instr[0].microbatch
        self.peak_live_activations = 0
        # Optional: a callable taking the Action and returning a context manager that wraps each
        # forward/backward (benchmarks/pp_bench.py times compute with it; None costs nothing).
        self.compute_timer: Optional[Callable[[Action], ContextManager]] = None
        self._loss_for_backward: Dict[int, torch.Tensor] = {}
        self._kwarg_mbs: List[dict] = []                # this step's keyword inputs, per micro-batch
        self._loss_kwargs: dict = {}
        self._broken: Optional[BaseException] = None

    @property
    def stages(self) -> List[PipelineStage]:
        return [self._stages[k] for k in sorted(self._stages)]

    # --- step ------------------------------------------------------------------------------
    def step(self, *inputs, target=None, losses: Optional[list] = None, return_outputs: bool = True,
             loss_kwargs: Optional[dict] = None, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        """One training step over n_microbatches micro-batches. Inputs are needed on the rank of
        the first stage, target on the last (ignored elsewhere); keyword inputs, split as inputs are,
        go to every stage of the rank they are given on, loss_kwargs to loss_fn. On the last stage's
        rank, `losses` is cleared and filled with each micro-batch's (unscaled) loss, and step()
        returns the merged output in the structure the module returns (tensor, tuple or list) unless
        return_outputs=False; else None. With scale_grads, each stage parameter's .grad is divided by
        n_microbatches after the step's backwards (all of it, including what earlier steps left), as
        torch.distributed.pipelining. Without a loss_fn it runs the forwards only, as eval(); with
        one, not under torch.no_grad(). torch's pre-split arg_mbs / kwarg_mbs / target_mbs raise
        ValueError."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("pipeline step: step() runs backward and needs gradients enabled, not torch.no_grad(); "
                               "call eval() for forwards only (as torch.distributed.pipelining)")
        pre_split = [n for n, v in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs))
                     if v is not None]
        if pre_split:
            raise ValueError(f"pipeline step: pre-split micro-batches ({', '.join(pre_split)}) are not supported; "
                             f"pass the whole batch (inputs, keyword inputs, target=): step() splits it along dim 0")
        if self._broken is not None:
            raise RuntimeError(f"{type(self).__name__}: a previous step failed ({self._broken!r}); the pipeline "
                               f"ranks may be out of step, build a new schedule and process group") from self._broken
        m = self.n_microbatches
        first, last = self._stages.get(0), self._stages.get(self.layout.num_stages - 1)
        input_chunks = target_chunks = None
        if first is not None:
            if not inputs and not kwargs:
                raise ValueError("pipeline step: this rank holds the first stage, so step() needs its inputs")
            input_chunks = split_microbatches("inputs", inputs, m)
        if kwargs and any(s.graphs is not None for s in self._stages.values()):
            raise ValueError("pipeline step: keyword inputs are not supported with cuda_graph=True stages")
        names = list(kwargs)
        self._kwarg_mbs = [dict(zip(names, mb)) for mb in split_microbatches("kwargs", list(kwargs.values()), m)]
        self._loss_kwargs = dict(loss_kwargs or {})
        if last is not None and self.loss_fn is not None:
            if target is None:
                raise ValueError("pipeline step: this rank holds the last stage, so step() needs target=")
            target_chunks = [t[0] for t in split_microbatches("target", [target], m)]
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"pipeline step: losses must be a list (or None), got {type(losses).__name__}")
        for s in self._stages.values():
            s._reset_step()
        self._loss_for_backward.clear()
        try:
            self._run(input_chunks, target_chunks, self.program if self._has_backward else self.forward_program)
            for s in self._stages.values():
                if not self._has_backward:
                    s._drop_activations()
                elif self.scale_grads:
                    s.scale_grads(m)
        except BaseException as e:
            self._broken = e
            raise
        if last is None:
            return None
        if losses is not None:
            if self.loss_fn is None:   # torch raises here too, after the step (every rank ran it)
                raise RuntimeError(f"pipeline step: losses= needs a loss_fn; this {type(self).__name__} has none")
            losses[:] = [last.losses[j] for j in range(m)]
        if not return_outputs:
            return None
        outs = [last.outputs[j] for j in range(m)]
        return last.as_returned([torch.cat([o[i] for o in outs]) for i in range(len(outs[0]))])

    def eval(self, *inputs, target=None, losses: Optional[list] = None, **kwargs):
        """step() without backward (torch.distributed.pipelining's eval): the forwards of every
        micro-batch, losses if this schedule has a loss_fn, no gradients; returns as step()."""
        has_backward, self._has_backward = self._has_backward, False
        try:
            return self.step(*inputs, target=target, losses=losses, **kwargs)
        finally:
            self._has_backward = has_backward

    def _run(self, input_mbs, target_mbs, program: List[Instruction]):
        pending_sends = []
        live = peak = 0
        for instr in program:
            a = instr[0]
            if a.type.is_compute:
                with self.compute_timer(a) if self.compute_timer is not None else contextlib.nullcontext():
                    if a.type is A.FORWARD:
                        self._forward(a, input_mbs, target_mbs)
                    else:
                        self._backward(a)
                live += 1 if a.type is A.FORWARD else -1
                peak = max(peak, live)
            else:
                work, has_recv = self._exchange(instr)
                if work is not None:
                    if has_recv:
                        work.wait()
                    else:
                        pending_sends.append(work)
        for work in pending_sends:
            work.wait()
        self.peak_live_activations = peak

    def _forward(self, a: Action, input_mbs, target_mbs):
        stage = self._stages[a.stage]
        j = a.microbatch
        if stage.is_first:
            args = input_mbs[j]
        elif a.stage - 1 in self._stages:
            args = stage.local_inputs_from(self._stages[a.stage - 1], j)
        else:
            args = stage.received_inputs(j)
        out = stage.forward_one_chunk(j, args, self._kwarg_mbs[j])
        if stage.is_last and self.loss_fn is not None:
            loss = self.loss_fn(stage.as_returned(out), target_mbs[j], **self._loss_kwargs)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"pipeline: loss_fn must return a scalar tensor, got "
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
            stage.losses[j] = loss.detach()
            # Unscaled, as torch.distributed.pipelining: step() divides the accumulated .grad by
            # n_microbatches afterwards (scale_grads), so a mean-reduced loss gives the whole batch's.
            if self._has_backward:
                self._loss_for_backward[j] = loss

    def _backward(self, a: Action):
        stage = self._stages[a.stage]
        j = a.microbatch
        sync = j == self._last_backward[a.stage]
        if stage.is_last:
            stage.backward_one_chunk(j, loss=self._loss_for_backward.pop(j), sync_grads=sync)
        elif a.stage + 1 in self._stages:
            grads = self._stages[a.stage + 1].input_grads_to_send(j)
            stage.backward_one_chunk(j, output_grads=grads, sync_grads=sync)
        else:
            stage.backward_one_chunk(j, sync_grads=sync)

    def _exchange(self, instr: Instruction):
        """Post one batch of sends/recvs; finish the metadata receives once it completes."""
        sends, recvs, meta_recvs = [], [], []
        for a in instr:
            stage = self._stages[a.stage]
            peer = self.layout.rank_of(a.peer_stage())
            j = a.microbatch
            if a.type is A.SEND_F:
                sends += [(t, peer) for t in stage.outputs_to_send(j)]
            elif a.type is A.RECV_F:
                recvs += [(t, peer) for t in stage.input_buffers(j)]
            elif a.type is A.SEND_B:
                sends += [(t, peer) for t in stage.input_grads_to_send(j)]
            elif a.type is A.RECV_B:
                recvs += [(t, peer) for t in stage.output_grad_buffers(j)]
            elif a.type is A.SEND_META:
                metas = tensor_meta(stage.outputs_of(j))
                sends += [(t, peer) for t in self._transport.meta_messages(metas, stage.outputs_meta_sent)]
                stage.outputs_meta_sent = metas
            elif a.type is A.RECV_META:
                header = self._transport.header_buffer()
                recvs.append((header, peer))
                meta_recvs.append((stage, header, peer))
        work = self._transport.start(sends, recvs)
        if meta_recvs:
            work.wait()
            for stage, header, peer in meta_recvs:
                stage.inputs_meta = self._transport.finish_recv_meta(header, peer, stage.inputs_meta)
            return None, False
        return work, bool(recvs)


class ScheduleGPipe(_PipelineSchedule):
    """All forwards, then all backwards (arXiv:1811.06965); holds m micro-batches' activations."""
    kind = ScheduleKind.GPIPE

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True):
        _default_specs_only(type(self), args_chunk_spec, kwargs_chunk_spec, output_merge_spec)
        super().__init__([stage], n_microbatches, loss_fn, scale_grads)


class Schedule1F1B(_PipelineSchedule):
    """One forward one backward after a warm-up (arXiv:2006.09503); holds ≤ p micro-batches."""
    kind = ScheduleKind.ONE_F_ONE_B

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True):
        _default_specs_only(type(self), args_chunk_spec, kwargs_chunk_spec, output_merge_spec)
        super().__init__([stage], n_microbatches, loss_fn, scale_grads)


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """Several stages per rank (stage k on pp rank k % p), Megatron's interleaved order
    (arXiv:2104.04473): bubble (p - 1)/(v·m + p - 1). n_microbatches must be a multiple of p."""
    kind = ScheduleKind.INTERLEAVED_1F1B

    def __init__(self, stages: List[PipelineStage], n_microbatches: int, loss_fn: Optional[Callable] = None,
                 args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None, scale_grads: bool = True):
        _default_specs_only(type(self), args_chunk_spec, kwargs_chunk_spec, output_merge_spec)
        if not isinstance(stages, (list, tuple)) or not stages:
            raise TypeError(f"ScheduleInterleaved1F1B: stages must be a non-empty list of PipelineStage, "
                            f"got {type(stages).__name__}")
        super().__init__(list(stages), n_microbatches, loss_fn, scale_grads)
