"""What an NCCL time-out does, on any machine (issue 20): the policy a Communicator gets from
its arguments and the environment (resolved in C++, as init_process_group's communicators are),
and the default action, which ends the process with one message and exit code 75. The GPU
scenarios are in test_faults_gpu.py (several GPUs) and test_nccl_timeouts_lifecycle.py (one)."""
import subprocess
import sys

import pytest

from pynccl import _ext
from pynccl.comm.backends.nccl import NcclOptions
from pynccl.errors import TIMEOUT_EXIT_CODE

pytestmark = pytest.mark.skipif(not _ext.available(), reason=f"pynccl._C not built: {_ext.import_error()!r}")


@pytest.fixture
def policy(monkeypatch):
    monkeypatch.delenv("PYNCCL_ON_TIMEOUT", raising=False)
    monkeypatch.delenv("PYNCCL_NCCL_NONBLOCKING", raising=False)
    return _ext._C.timeout_policy


def test_default_is_blocking_and_teardown(policy):
    assert policy() == {"blocking": True, "on_timeout": "teardown"}
    # NcclOptions leaves both to the C++ resolution, so a direct Communicator matches init_process_group's.
    assert NcclOptions().blocking is None and NcclOptions().on_timeout is None


def test_raise_from_env_picks_non_blocking(policy, monkeypatch):
    monkeypatch.setenv("PYNCCL_ON_TIMEOUT", "raise")
    assert policy() == {"blocking": False, "on_timeout": "raise"}
    assert policy(on_timeout="teardown") == {"blocking": True, "on_timeout": "teardown"}  # the argument wins


def test_nonblocking_env_keeps_teardown(policy, monkeypatch):
    monkeypatch.setenv("PYNCCL_NCCL_NONBLOCKING", "1")
    assert policy() == {"blocking": False, "on_timeout": "teardown"}
    assert policy(blocking=True) == {"blocking": True, "on_timeout": "teardown"}


def test_arguments_without_env(policy):
    assert policy(on_timeout="raise") == {"blocking": False, "on_timeout": "raise"}
    assert policy(blocking=False) == {"blocking": False, "on_timeout": "teardown"}


def test_bad_policy_values_name_what_was_given(policy, monkeypatch):
    with pytest.raises(ValueError, match=r"on_timeout \(PYNCCL_ON_TIMEOUT\) must be 'teardown' or 'raise', got 'abort'"):
        policy(on_timeout="abort")
    with pytest.raises(ValueError, match=r"on_timeout='raise' needs a non-blocking communicator.*got blocking=True"):
        policy(on_timeout="raise", blocking=True)
    monkeypatch.setenv("PYNCCL_ON_TIMEOUT", "Raise")
    with pytest.raises(ValueError, match="got 'Raise'"):
        policy()


def test_watchdog_sees_a_call_past_its_deadline_only():
    overdue = _ext._C._overdue_call_for_test
    s = 1_000_000_000
    start = 5 * s
    assert overdue("all_reduce", 7, start, start + 9 * s, 10.0) == ""          # still within the timeout
    expected = ("all_reduce (seq 7) did not complete within 10 s: this rank is still inside the NCCL call, "
                "waiting for a peer that did not arrive")
    assert overdue("all_reduce", 7, start, start + 10 * s + 1, 10.0) == expected
    assert overdue("init", 0, start, start + 11 * s, 10.0).startswith("init (seq 0) did not complete within 10 s")
    assert overdue("all_reduce", 7, start, start + 60 * s, 10.0, cleared=True) == ""  # the call returned
    assert overdue("send", 3, start, start + 600 * s, 0.5).startswith("send (seq 3) did not complete within 0.5 s")


def test_exit_code_is_one_constant():
    assert _ext._C.TIMEOUT_EXIT_CODE == TIMEOUT_EXIT_CODE == 75


_TEAR_DOWN = """
import threading
from pynccl import _ext
print("before", flush=True)
# NOTE: from a thread other than the one holding the GIL, as the watchdog does.
t = threading.Thread(target=_ext._C._tear_down_for_test,
                     args=("communicator 'world' (rank 0 of 2, cuda:0): watchdog: all_reduce (seq 7) did not "
                           "complete within 10 s. Flight record: /tmp/x.json",))
t.start()
t.join()
print("after", flush=True)
"""


def test_tear_down_ends_the_process_with_one_message():
    proc = subprocess.run([sys.executable, "-c", _TEAR_DOWN], capture_output=True, text=True, timeout=60)
    assert proc.returncode == TIMEOUT_EXIT_CODE, (proc.returncode, proc.stderr)
    assert proc.stdout == "before\n"  # the process ended inside the call
    lines = proc.stderr.splitlines()
    assert lines[0] == ("pynccl: communicator 'world' (rank 0 of 2, cuda:0): watchdog: all_reduce (seq 7) did not "
                        "complete within 10 s. Flight record: /tmp/x.json"), proc.stderr
    assert lines[1].startswith("pynccl: ending this process with exit code 75 so that no result of the unfinished "
                               "op reaches the program (PYNCCL_ON_TIMEOUT=raise raises pynccl.CommTimeoutError "
                               "instead)"), proc.stderr
    assert len(lines) == 2, proc.stderr
