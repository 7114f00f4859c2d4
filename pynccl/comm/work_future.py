"""Work.get_future(): a torch.futures.Future for an async op, with torch's semantics per backend.

The functions of pynccl.comm.distributed remember each async op's output tensors here (weakly, by
Work), so the future's value is that list, as torch's (all_reduce: [tensor]).
* nccl (pynccl._C.Work): as torch's ProcessGroupNCCL, a CUDA-aware future that is complete on the
  host at once; its value is ordered after the op on the GPU: fut.wait() / fut.value() and then()
  callbacks make the *current* stream wait for the op (no host block), so reading a value on the
  host (.cpu(), .item()) sees the result. get_future() itself leaves the caller's stream alone: the
  op's end event is recorded into the future from a side stream.
* gloo (GlooWork) and CPU work: completed by gloo's worker thread when the op finishes (after what
  must follow it, e.g. AVG's division); then() callbacks run then.
"""
from __future__ import annotations

import weakref
from typing import Dict, List

import torch

from .. import _ext

_outputs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_side_streams: Dict[int, "torch.cuda.Stream"] = {}


def remember(work, outputs: List) -> None:
    """Record `work`'s output tensors (the future's value). Called on async paths only."""
    if work is not None:
        _outputs[work] = outputs


def outputs_of(work) -> List:
    return _outputs.get(work, [])


def completed_future(value) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def cuda_work_future(work) -> torch.futures.Future:
    """get_future() of a pynccl._C.Work (installed on the class by install())."""
    value = outputs_of(work)
    tensors = [t for t in _flatten(value) if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())
    stream = _side_streams.get(device.index)
    if stream is None:
        stream = _side_streams[device.index] = torch.cuda.Stream(device)
    fut = torch.futures.Future(devices=[device])
    # NOTE: the side stream first waits for what the caller queued (the op's inputs were written
    # there), then for the op; set_result records an event on it that fut.wait() later waits on.
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        work.wait()
        fut.set_result(value)
    return fut


def _flatten(value):
    for v in value:
        if isinstance(v, (list, tuple)):
            yield from _flatten(v)
        else:
            yield v


def install() -> None:
    """Give pynccl._C.Work torch's get_future() (the C++ class is not ours to extend in csrc)."""
    if _ext._C is not None and not hasattr(_ext._C.Work, "get_future"):
        _ext._C.Work.get_future = cuda_work_future
