"""torch's Work API on pynccl's C++ Work: get_future() and wait(timeout), with torch's semantics.

Work.wait(timeout): as torch's ProcessGroupNCCL Work, no timeout (None, or torch's default
timedelta(0)) makes the current stream wait for the op; a timeout (a timedelta, or seconds) also
blocks the host until the op completes, at most that long, then raises CommTimeoutError (the op
is left running: its communicator is not aborted, as torch's wait does not abort either).

Work.get_future(): a torch.futures.Future for an async op, with torch's semantics per backend.

The functions of pynccl.comm.distributed remember each async op's output tensors here (weakly, by
Work), so the future's value is that list, as torch's (all_reduce: [tensor]).
* nccl (pynccl._C.Work): as torch's ProcessGroupNCCL, a CUDA-aware future that is complete on the
  host at once; its value is ordered after the op on the GPU: fut.wait() / fut.value() and then()
  callbacks make the *current* stream wait for the op (no host block), so reading a value on the
  host (.cpu(), .item()) sees the result. get_future() itself leaves the caller's stream alone: the
  op's end event is recorded into the future from a side stream.
* gloo (GlooWork) and CPU work: completed by gloo's worker thread when the op finishes (after what
  must follow it, e.g. AVG's division); then() callbacks run then.

Work.result() / is_success() / exception() (torch's, deprecated there): on gloo as torch's gloo Work
(backends/base.py). On pynccl._C.Work as torch's ProcessGroupNCCL Work: result() gives the output
tensors at once (their values are ordered after the op on the GPU, as get_future()'s);
is_success() raises, as torch's WorkNCCL; exception() raises too: the C++ Work keeps no error of its
own (wait() / synchronize() raise the communicator's).
"""
from __future__ import annotations

import datetime
import time
import weakref
from typing import Dict, List, Optional, Union

import torch

from .. import _ext
from ..errors import CommTimeoutError

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


def cuda_work_result(work) -> List:
    """result() of a pynccl._C.Work, as torch's WorkNCCL::result: the op's output tensors (get_future()'s
    value), without waiting; read them after wait() (the current stream) or synchronize() (the host)."""
    return list(outputs_of(work))


def cuda_work_is_success(work) -> bool:
    raise NotImplementedError(f"Work.is_success: not available on an nccl Work ({work.op}, seq {work.seq}), as on "
                              f"torch's (WorkNCCL::isSuccess is deprecated there and raises); synchronize() raises "
                              f"the op's error, is_completed() says whether it has finished")


def cuda_work_exception(work):
    raise NotImplementedError(f"Work.exception: an nccl Work ({work.op}, seq {work.seq}) keeps no error of its own; "
                              f"wait() and synchronize() raise the communicator's error, as does the group's "
                              f"backend.check()")


def _flatten(value):
    for v in value:
        if isinstance(v, (list, tuple)):
            yield from _flatten(v)
        else:
            yield v


def wait_timeout_seconds(timeout: Union[None, float, datetime.timedelta]) -> Optional[float]:
    """Work.wait's `timeout` in seconds, or None for "no timeout of the call's own" (the group's
    bound applies): torch passes a timedelta, whose default timedelta(0) means none; pynccl 0.1
    documented seconds (a number), still taken."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(f"Work.wait: timeout must be a datetime.timedelta (as torch's) or a number of seconds "
                         f">= 0, got {timeout!r}")
    return None if seconds == 0 else float(seconds)


def _timed_wait(cpp_wait):
    """Work.wait with torch's `timeout` around the C++ wait (which orders the current stream)."""
    def wait(work, timeout=None) -> bool:
        if timeout is not None:
            seconds = wait_timeout_seconds(timeout)
            if seconds is not None:
                _host_wait(work, seconds)
        return cpp_wait(work)
    wait.__doc__ = (f"{cpp_wait.__doc__ or ''} With a timeout (a timedelta, as torch's, or seconds): the host "
                    f"first waits for the op, at most that long, and CommTimeoutError is raised past it.")
    return wait


def _host_wait(work, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    pause = 1e-5
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise CommTimeoutError(f"Work.wait: {work.op} (seq {work.seq}) did not complete within {seconds:g} s "
                                   f"(the op is still running; its communicator is left as it is)")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def install() -> None:
    """Give pynccl._C.Work torch's get_future(), wait(timeout), result(), is_success() and exception()
    (the C++ class is not ours to extend in csrc)."""
    if _ext._C is None or hasattr(_ext._C.Work, "get_future"):
        return
    _ext._C.Work.get_future = cuda_work_future
    _ext._C.Work.wait = _timed_wait(_ext._C.Work.wait)
    _ext._C.Work.result = cuda_work_result
    _ext._C.Work.is_success = cuda_work_is_success
    _ext._C.Work.exception = cuda_work_exception
