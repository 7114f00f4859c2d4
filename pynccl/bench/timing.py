"""How one cell is timed: n enqueues, then wait for the device; or n ops captured in a CUDA
graph and replayed. Kept apart from the sweep so the hot loop is easy to read and to audit:
nothing runs inside it but the op calls themselves.
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, List, Optional, Tuple

import torch

_perf_counter = time.perf_counter


@contextlib.contextmanager
def _no_gc():
    """A collection inside the loop would be charged to whichever op it hit."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def timed_loop(calls: List[Callable[[], None]], sync: Callable[[], None]) -> Tuple[float, float]:
    """(host seconds to enqueue all calls, wall seconds until the device finished them)."""
    with _no_gc():
        t0 = _perf_counter()
        for call in calls:
            call()
        t1 = _perf_counter()
        sync()
        t2 = _perf_counter()
    return t1 - t0, t2 - t0


def timed_replay(graph, launches: int, sync: Callable[[], None]) -> Tuple[float, float]:
    """As timed_loop, for `launches` replays of a captured graph."""
    replay = graph.replay
    with _no_gc():
        t0 = _perf_counter()
        for _ in range(launches):
            replay()
        t1 = _perf_counter()
        sync()
        t2 = _perf_counter()
    return t1 - t0, t2 - t0


class GraphCapturer:
    """Captures calls into torch.cuda.CUDAGraph on one side stream.

    Uses capture_begin/capture_end rather than the torch.cuda.graph context manager, which runs
    gc.collect() and empty_cache() on every capture (tens of ms, per cell). Thread-local capture
    mode, as nccl-tests uses: communicator watchdog threads may query events meanwhile.
    """

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"-G (CUDA graphs) needs CUDA tensors (the nccl backend); this run's device is "
                             f"{device}. Drop -G, or run with --backend nccl on a GPU")
        self.stream = torch.cuda.Stream(device=device)

    def capture(self, calls: List[Callable[[], None]]):
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(capture_error_mode="thread_local")
            failure: Optional[BaseException] = None
            try:
                for call in calls:
                    call()
            except BaseException as e:  # noqa: BLE001 - re-raised after the capture is closed
                failure = e
            try:
                graph.capture_end()
            except BaseException:  # noqa: BLE001
                if failure is None:
                    raise
            if failure is not None:
                raise failure
        current.wait_stream(self.stream)
        return graph


def device_sync(device: torch.device) -> Callable[[], None]:
    """What 'until the streams finish' means on this device (nothing to wait for on CPU: gloo ops
    with async_op=False return when done)."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
