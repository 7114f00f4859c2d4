"""Calls of the wrapped module that do not come through the wrapper's forward: model.module(...) and
Hugging Face generate() (model.generate delegates to model.module.generate, which calls the module once
per token). As FSDP2's root hooks do, hooks on the module make each such call what the wrapper's forward
makes of it: inputs cast, stage 3's root unit gathered and its block walk started, the saved-tensor hooks
on under grad, everything released after the call (stages 1/2: the shards of the last step gathered first).

The wrapper's forward calls the module too: it flags that call, and the hooks stand aside for it. The
flag is read in the hook itself, which torch.compile of the wrapper traces (a flag test, no graph break);
what a direct call does runs eagerly (_disable_dynamo), as the wrapper's own bookkeeping does.
"""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch
from torch import nn

from .mixed_precision import cast_inputs, cast_outputs


def hooked_module(module: nn.Module) -> nn.Module:
    """The module whose calls are hooked: a torch.compile'd module's original (its generate, reached through
    OptimizedModule's attribute forwarding, calls the original, not the compiled wrapper)."""
    orig = getattr(module, "_orig_mod", None)
    return orig if isinstance(orig, nn.Module) else module


class RootCallHooks:
    """Forward hooks on the wrapped module of a FullyShardedDataParallel (held weakly: a dropped wrapper
    leaves hooks that do nothing). NOTE: collective, as the wrapper's forward is: every rank makes the same
    direct calls in the same order (generate on every rank with the same inputs, as FSDP2 requires)."""

    def __init__(self, wrapper: nn.Module):
        self.wrapper_call_next = False                 # set by the wrapper's forward right before it calls the module
        self._wrapper = weakref.ref(wrapper)
        self._calls: List[Optional[torch.autograd.graph.saved_tensors_hooks]] = []   # direct calls running
        target = hooked_module(wrapper.module)
        if wrapper.stage == 3:
            # NOTE: the marker Hugging Face reads for FSDP2 (transformers' is_fsdp_managed_module): generate then
            # defaults to synced_gpus=True at world size > 1, so a rank whose sequences end first keeps making
            # forward calls (their gathers) until every rank's end; without it the ranks' collectives part ways.
            target._is_fsdp_managed_module = True
        # The gather runs before the user's own pre-hooks (they may read parameters), the release after
        # the forward hooks registered so far; the always-called one ends a call that raised.
        self.handles = [target.register_forward_pre_hook(self._pre, prepend=True, with_kwargs=True),
                        target.register_forward_hook(self._post),
                        target.register_forward_hook(self._end, always_call=True)]

    def _pre(self, module, args, kwargs):
        if self.wrapper_call_next:                     # the wrapper's forward does it all
            self.wrapper_call_next = False
            return None
        return self._begin(args, kwargs)

    def _post(self, module, args, output):
        return self._finish(output) if self._calls else None

    def _end(self, module, args, output):
        if self._calls:                                # the call raised before _post ended it
            self._close(self._calls.pop())

    @torch._disable_dynamo                             # collectives and parameter swaps run eagerly
    def _begin(self, args, kwargs):
        wrapper = self._wrapper()
        if wrapper is None:
            return None
        args, kwargs = cast_inputs(wrapper.policy, args, kwargs)
        wrapper._pre_forward(wrapper_call=False)
        saved = None
        if wrapper.stage == 3 and torch.is_grad_enabled():     # a training call: backward re-gathers (stage3.py)
            saved = torch.autograd.graph.saved_tensors_hooks(wrapper._runtime.pack, wrapper._runtime.unpack)
            saved.__enter__()
        self._calls.append(saved)
        return args, kwargs

    @torch._disable_dynamo
    def _finish(self, output):
        self._close(self._calls.pop())
        wrapper = self._wrapper()
        if wrapper is None:
            return None
        if wrapper.stage == 3:
            wrapper._runtime.post_root_forward(output)
        return cast_outputs(wrapper.policy, output)

    @staticmethod
    def _close(saved) -> None:
        if saved is not None:
            saved.__exit__(None, None, None)
