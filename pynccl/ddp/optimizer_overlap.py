"""The optimizer step in backward, a bucket at a time (issue 26, opt-in; torch's experimental
DistributedDataParallel._register_fused_optim): as soon as a bucket's all-reduce ends, its
gradients are written back and its parameters stepped, on a side stream, while backward and the
later buckets' reductions go on. The step the loop calls then has nothing left to do but wait.

    opt = torch.optim.AdamW(groups, lr=6e-4, fused=True)      # as the script builds it
    opt = model.overlap_optimizer(opt)                        # the same object, now stepped in backward
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()                                # each bucket's step runs in here
        opt.step()                                            # waits for them; updates nothing more

Exact: the optimizers torch ships update each element from its own gradient and state, so one
step per bucket, with the same hyperparameters (each bucket's param groups mirror the user's and
are refreshed from them before every step, so LR schedulers on the user's optimizer work) and
the same state (every bucket optimizer shares the user optimizer's `state`, so its state_dict()
and load_state_dict() hold everything), equals one step over all parameters (tests check bit
equality). What needs every gradient before the step cannot come after it: clip_grad_norm_,
GradScaler's unscale/inf check, closures, and find_unused_parameters (the unused set is known
only at the end of backward) are refused.
"""
from __future__ import annotations

import inspect
import types
import weakref
from typing import Dict, List

import torch


class OptimizerOverlap:
    """One optimizer of the user's class per bucket, stepped when the bucket is reduced."""

    def __init__(self, reducer, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"overlap_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if reducer.find_unused:
            raise ValueError("overlap_optimizer: find_unused_parameters=True is not supported (which parameters "
                             "went unused is known only at the end of backward, after the steps)")
        mine = {id(p) for p in reducer.params}
        theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if mine != theirs:
            raise ValueError(f"overlap_optimizer: the optimizer must hold exactly the model's trainable parameters: "
                             f"{len(theirs - mine)} of its parameters are not the model's, {len(mine - theirs)} of the "
                             f"model's are not in it")
        self.reducer = reducer
        self.optimizer = optimizer
        self.stream = torch.cuda.Stream(reducer.device) if reducer.device.type == "cuda" else None
        self.stepped: set = set()                      # indices of buckets stepped in this backward
        self.rebuild()
        # A bound method, as LR schedulers expect of optimizer.step (they wrap its __func__).
        optimizer._pynccl_overlap = weakref.ref(self)
        optimizer.step = types.MethodType(_overlapped_step, optimizer)

    def rebuild(self) -> None:
        """One optimizer per bucket (after the buckets are (re)built), its groups mirroring the
        user's groups restricted to the bucket's parameters."""
        group_of: Dict[int, int] = {id(p): gi for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        cls = type(self.optimizer)
        # The user's defaults that the constructor takes (torch keeps some derived ones there too).
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        self.per_bucket: List[torch.optim.Optimizer] = []
        self.group_index: List[List[int]] = []         # per bucket: the user group of each of its groups
        for b in self.reducer.bucketer.buckets:
            by_group: Dict[int, list] = {}
            for p in b.params:
                by_group.setdefault(group_of[id(p)], []).append(p)
            groups = [dict(self._options(gi), params=ps) for gi, ps in sorted(by_group.items())]
            opt = cls(groups, **defaults)
            opt.state = self.optimizer.state           # NOTE: one state for all: the user's state_dict() sees it
            self.per_bucket.append(opt)
            self.group_index.append(sorted(by_group))

    def _options(self, gi: int) -> dict:
        return {k: v for k, v in self.optimizer.param_groups[gi].items() if k != "params"}

    def step_bucket(self, b, reduced) -> None:
        """Called right after bucket b's reduction started: write it back and step its parameters
        once it ends (on the side stream on CUDA; at once on gloo)."""
        opt = self.per_bucket[b.index]
        opt.state = self.optimizer.state               # a load_state_dict() may have replaced it
        for group, gi in zip(opt.param_groups, self.group_index[b.index]):
            group.update(self._options(gi))            # LR schedulers change the user's groups
        if self.stream is None:
            self.reducer._write_back(b, reduced.wait(), set())
            opt.step()
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.reducer.device))
            with torch.cuda.stream(self.stream):
                self.reducer._write_back(b, reduced.wait(), set())
                opt.step()
        self.stepped.add(b.index)

    def finish_backward(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.reducer.device).wait_stream(self.stream)
        self.stepped.clear()

    def wait(self, closure=None):
        if closure is not None:
            raise ValueError("overlap_optimizer: step(closure) is not supported: the step already ran in backward")
        if self.stream is not None:
            torch.cuda.current_stream(self.reducer.device).wait_stream(self.stream)
        return None


def _overlapped_step(optimizer, closure=None):
    """optimizer.step of an overlapped optimizer: the steps ran in backward; wait for them."""
    overlap = optimizer._pynccl_overlap()
    return None if overlap is None else overlap.wait(closure)
