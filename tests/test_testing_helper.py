"""pynccl.testing.run_multiprocess: results per rank; a rank that raises is named with its
traceback; a rank that hangs is killed after the timeout and named with where it hung."""
import time

import pytest

from pynccl.testing import MultiProcessError, run_multiprocess


def _ok(rank, world_size):
    return rank * 10 + world_size


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def _wait_forever_in_a_named_function(rank, world_size):
    if rank == 1:
        while True:
            time.sleep(0.05)
    return rank


def test_results_in_rank_order():
    assert run_multiprocess(_ok, 3, backend=None, timeout=60) == [3, 13, 23]


def test_raising_rank_is_named_with_its_traceback():
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(_rank1_raises, 2, backend=None, timeout=60)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "ValueError: rank one is broken" in msg and "rank 0" not in msg


def test_hung_rank_is_killed_and_its_stack_reported():
    start = time.monotonic()
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(_wait_forever_in_a_named_function, 2, backend=None, timeout=3)
    assert time.monotonic() - start < 20
    msg = str(info.value)
    assert "rank 1: still running after the 3s timeout (killed)" in msg
    assert "_wait_forever_in_a_named_function" in msg, msg
    assert "rank 0" not in msg


class _HangsWhenCollected:
    def __del__(self):
        while True:
            time.sleep(0.05)


def _raise_then_hang_in_teardown(rank, world_size):
    if rank == 1:
        held = _HangsWhenCollected()
        held.me = held        # a cycle: freed only by the collection the teardown runs before aborting
        raise ValueError("rank one raised first")
    return rank


def test_rank_that_raised_then_hung_in_teardown_reports_both():
    """The error a rank raised is not lost when its teardown then hangs (session 16: the 4-rank
    CUDA-graph test's errors showed only as hangs in ncclCommAbort)."""
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(_raise_then_hang_in_teardown, 2, backend=None, timeout=5)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "ValueError: rank one raised first" in msg, msg
    assert "then rank 1: still running after the 5s timeout (killed)" in msg, msg
    assert "_HangsWhenCollected" in msg or "__del__" in msg, msg     # where it hung: the collection
    assert "rank 0" not in msg
