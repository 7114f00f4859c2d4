"""torch's coalesced collectives: all_reduce_coalesced as one flat all-reduce per dtype, and
all_gather_coalesced (deprecated in torch, still exported by 2.11, so here too) as one flat
all-gather.

Many small tensors cost one collective (per dtype) instead of one each: they are copied into a flat
buffer, reduced or gathered, and copied back.
"""
from __future__ import annotations

import threading
import warnings
from typing import Dict, List, Optional

import torch

from .backends.base import Work
from .collectives import _check_list, _check_same, _check_tensor, _skip
from .groups import resolve_group
from .membership import is_non_member
from .reduce_op import ReduceOp, as_reduce_op
from .work_future import outputs_of, remember


class CoalescedWork(Work):
    """The per-dtype all-reduces; wait() waits for them (the current stream on CUDA, the host on
    gloo), then copies the results back into the caller's tensors (ordered after the reduces)."""

    def __init__(self, works: List, flats: List[torch.Tensor], targets: List[List[torch.Tensor]]):
        self._works = works
        self._flats = flats
        self._targets = targets
        self._done = False
        # NOTE: the copy-back runs once, whichever of wait(), is_completed() and the future's
        # callback (gloo's worker thread) gets there first.
        self._lock = threading.Lock()

    def wait(self, timeout=None) -> bool:
        if self._done:
            return True
        for w in self._works:
            w.wait(timeout)
        with self._lock:
            if not self._done:
                for flat, tensors in zip(self._flats, self._targets):
                    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
                        t.copy_(chunk.view_as(t))
                self._done = True
        return True

    def is_completed(self) -> bool:
        """Non-blocking: True once the ops have finished and their results are copied back into the
        caller's tensors (or an op failed: exception()). NOTE: on CUDA the copy-back is then queued on
        the current stream, so the tensors hold the results in its order, as after wait()."""
        if self._done:
            return True
        if not all(w.is_completed() for w in self._works):
            return False
        try:
            self.wait()   # no host wait: the ops have completed
        except Exception:  # noqa: BLE001 - an op's error: exception() gives it, wait() raises it
            pass
        return True

    def exception(self) -> Optional[BaseException]:
        """The first failed op's error, else None (on nccl, as its Work's exception(): unavailable)."""
        for w in self._works:
            error = w.exception()
            if error is not None:
                return error
        return None

    def get_future(self) -> torch.futures.Future:
        """Completed once the ops are, with the results copied back; value: the caller's tensors.
        NOTE: the inner futures complete on gloo's thread when the ops end, and at once on nccl
        (ordered on the GPU: wait() then makes the callback's, the caller's, stream wait)."""
        def done(_):
            self.wait()
            return outputs_of(self)
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(done)


def all_reduce_coalesced(tensors: List[torch.Tensor], op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch.distributed.all_reduce_coalesced: reduce every tensor of `tensors` in place, with one
    all-reduce per dtype (in order of first appearance, the same on every rank). async_op=True
    returns a torch.futures.Future (as torch's), whose value is `tensors`."""
    if is_non_member(group):
        return _skip("all_reduce_coalesced")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError("all_reduce_coalesced: tensors must be a non-empty list of tensors")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce_coalesced: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.device != tensors[0].device:
            raise ValueError(f"all_reduce_coalesced: tensors[{i}] is on {t.device}, tensors[0] on "
                             f"{tensors[0].device}; all must be on one device")
    op = as_reduce_op(op, "all_reduce_coalesced")
    g = resolve_group(group)
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    works, flats, targets = [], [], []
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        works.append(g.backend.all_reduce(flat, op, True))
        flats.append(flat)
        targets.append(group_tensors)
    return _finish(CoalescedWork(works, flats, targets), async_op, list(tensors))


def _finish(work: CoalescedWork, async_op: bool, outputs: List):
    """None once done, or (async_op) torch's return value for coalesced ops: the Work's future."""
    if not async_op:
        work.wait()
        return None
    remember(work, outputs)
    return work.get_future()


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op: bool = False):
    """torch.distributed.all_gather_coalesced (deprecated there, with a FutureWarning; so here):
    output_tensor_lists[i][j] = rank i's input_tensor_list[j], with one all-gather of the inputs
    flattened together (one dtype, as torch requires). async_op=True returns a
    torch.futures.Future (as torch's), whose value is output_tensor_lists."""
    warnings.warn("all_gather_coalesced is deprecated in torch.distributed (and so in pynccl); use "
                  "all_gather_into_tensor on the inputs flattened together", FutureWarning, stacklevel=2)
    if is_non_member(group):
        return _skip("all_gather_coalesced")
    fn = "all_gather_coalesced"
    if not isinstance(input_tensor_list, (list, tuple)) or not input_tensor_list:
        raise ValueError(f"{fn}: input_tensor_list must be a non-empty list of tensors")
    for i, t in enumerate(input_tensor_list):
        _check_tensor(fn, f"input_tensor_list[{i}]", t)
        _check_same(fn, "input_tensor_list[0]", input_tensor_list[0], f"input_tensor_list[{i}]", t)
    g = resolve_group(group)
    _check_list_of_lists(fn, output_tensor_lists, input_tensor_list, g.world_size)
    flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    flat_out = flat_in.new_empty(g.world_size * flat_in.numel())
    # NOTE: rank i's block of flat_out is its inputs back to back, so flat_out splits, in order,
    # into output_tensor_lists[0][0], [0][1], ..., [1][0], ...
    targets = [t for row in output_tensor_lists for t in row]
    work = CoalescedWork([g.backend.all_gather_into_tensor(flat_out, flat_in, True)], [flat_out], [targets])
    return _finish(work, async_op, list(output_tensor_lists))


def _check_list_of_lists(fn: str, outputs, inputs, n: int) -> None:
    if not isinstance(outputs, (list, tuple)) or len(outputs) != n:
        got = len(outputs) if isinstance(outputs, (list, tuple)) else type(outputs).__name__
        raise ValueError(f"{fn}: output_tensor_lists must be a list of world_size({n}) lists, got {got}")
    for i, row in enumerate(outputs):
        _check_list(fn, f"output_tensor_lists[{i}]", row, len(inputs), "len(input_tensor_list)")
        for j, (out, inp) in enumerate(zip(row, inputs)):
            _check_same(fn, f"input_tensor_list[{j}]", inp, f"output_tensor_lists[{i}][{j}]", out, inp.numel())
