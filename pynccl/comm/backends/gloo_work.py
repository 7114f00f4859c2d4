"""The gloo backend's Work: torch's gloo works for one op plus what must run once they finish
(AVG's division, a reduce_scatter's copy-out), completed once whichever of wait(), is_completed()
and gloo's worker thread (get_future's callback) gets there first. Complete means the output is
written: is_completed() runs what follows the torch works itself rather than report them alone."""
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
        self._error: Optional[BaseException] = None   # the op's own failure (not a wait's time-out)
        # NOTE: get_future's callback runs on gloo's worker thread; the lock makes `finish` run once
        # whichever of it, wait() and is_completed() gets there first.
        self._lock = threading.Lock()
        self._future = None

    def wait(self, timeout=None) -> bool:
        """Host wait for the op, at most `timeout` (a timedelta as torch's, or seconds; default and
        timedelta(0): the group's timeout); CommTimeoutError past it. A failed op raises its error."""
        if self._done:
            return True
        with self._lock:
            if self._error is not None:
                raise self._error
            if not self._done:
                t = wait_timeout_seconds(timeout)
                self._finish_locked(self._backend.timeout_s if t is None else t)
        return True

    def _finish_locked(self, timeout_s: float) -> None:
        """With the lock held: wait for the torch works (at most timeout_s), then _complete(); on an
        error, record it (where the op itself failed) and raise it."""
        try:
            with self._backend._translate_errors(self._op_name, self._seq, self._record):
                for w in self._works:
                    w.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            if all(w.is_completed() for w in self._works):   # the op failed, not merely this wait's time-out
                self._error = e
            if self._future is not None and not self._future.done():
                self._future.set_exception(e)
            raise
        self._complete()

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
                self._error = e
                self._future.set_exception(e)
                return
            self._complete()
        finally:
            self._lock.release()

    def is_completed(self) -> bool:
        """Non-blocking: True once the op's output is written (or the op failed: exception())."""
        if self._done or self._error is not None:
            return True
        if not all(w.is_completed() for w in self._works):
            return False
        # NOTE: gloo's works are done but what follows them (AVG's division, a reduce_scatter's
        # copy-out) may not have run: run it here, once, so that a completed Work holds its result
        # (torch's gloo Work completes after its whole op). A busy lock: wait() or gloo's thread is
        # running it now, so not complete yet.
        if not self._lock.acquire(blocking=False):
            return self._done
        try:
            if not self._done:
                self._finish_locked(self._backend.timeout_s)   # no host wait: the works have completed
        except Exception:  # noqa: BLE001 - the op's error: kept for exception(), raised by wait()
            pass
        finally:
            self._lock.release()
        return True

    def exception(self) -> Optional[BaseException]:
        """torch's Work.exception(): the op's error (pynccl's PyncclError / CommTimeoutError) once
        it has failed, else None."""
        self.is_completed()   # a failed op's error is recorded once its works are done
        return self._error

    def __repr__(self) -> str:
        return f"<GlooWork {self._op_name} seq={self._seq}>"

    def synchronize(self, timeout_s: Optional[float] = None) -> bool:
        """Host wait bounded by timeout_s (the group's by default), as the NCCL Work's."""
        return self.wait(timeout_s)
