"""The gloo backend's Work: torch's gloo works for one op plus what must run once they finish
(AVG's division, a reduce_scatter's copy-out), completed once whichever of wait() and gloo's
worker thread (get_future's callback) gets there first."""
from __future__ import annotations

import datetime
import threading
from typing import Optional

import torch

from .. import work_future
from .base import Work, wait_timeout_seconds


class GlooWork(Work):
    """torch Work objects plus what must run once they finish (e.g. AVG's division)."""

    def __init__(self, backend, op_name: str, seq: int, works, finish=None, record=None):
        self._backend = backend
        self._op_name = op_name
        self._seq = seq
        self._record = record
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        # NOTE: get_future's callback runs on gloo's worker thread; the lock makes `finish` run once
        # whichever of it and wait() gets there first.
        self._lock = threading.Lock()
        self._future = None

    def wait(self, timeout=None) -> bool:
        """Host wait for the op, at most `timeout` (a timedelta as torch's, or seconds; default and
        timedelta(0): the group's timeout); CommTimeoutError past it."""
        if self._done:
            return True
        with self._lock:
            if self._done:
                return True
            t = wait_timeout_seconds(timeout)
            t = self._backend.timeout_s if t is None else t
            try:
                with self._backend._translate_errors(self._op_name, self._seq, self._record):
                    for w in self._works:
                        w.wait(datetime.timedelta(seconds=t))
            except Exception as e:
                if self._future is not None and not self._future.done():
                    self._future.set_exception(e)
                raise
            self._complete()
        return True

    def _complete(self):
        """With the lock held, the torch works done: what follows the op, then the future."""
        if self._finish is not None:
            self._finish()
        if self._record is not None:
            self._record["state"] = "completed"
        self._done = True
        if self._future is not None and not self._future.done():
            self._future.set_result(work_future.outputs_of(self))

    def get_future(self) -> torch.futures.Future:
        """Completed when the op (and what follows it, e.g. AVG's division) is done; value: the
        op's output tensors. Callbacks run on gloo's worker thread."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = fut = torch.futures.Future()
            done = self._done
        if done:
            fut.set_result(work_future.outputs_of(self))
        elif not self._works:
            self.wait()
        else:
            torch.futures.collect_all([w.get_future() for w in self._works]).then(self._on_torch_done)
        return fut

    def _on_torch_done(self, torch_futures):
        if not self._lock.acquire(blocking=False):
            return   # wait() holds it: it completes the future itself
        try:
            if self._done:
                return
            try:
                with self._backend._translate_errors(self._op_name, self._seq, self._record):
                    for f in torch_futures.value():
                        f.value()   # raises the op's error
            except Exception as e:  # noqa: BLE001 - handed to the future
                self._future.set_exception(e)
                return
            self._complete()
        finally:
            self._lock.release()

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def synchronize(self, timeout_s: Optional[float] = None) -> bool:
        """Host wait bounded by timeout_s (the group's by default), as the NCCL Work's."""
        return self.wait(timeout_s)
