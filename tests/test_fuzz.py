"""10,000 random calls, valid and invalid, against the gloo backend in subprocesses with a
time-out: every call returns correct values or raises a Python exception; no crash, no hang.
(The NCCL backend gets the same driver in test_fuzz_gpu.py.)"""
import pytest

from fuzz_driver import run_fuzz
from pynccl.testing import run_multiprocess


@pytest.mark.parametrize("world_size,num_calls", [(2, 6000), (3, 4000)])
def test_fuzz_gloo(world_size, num_calls):
    out = run_multiprocess(run_fuzz, world_size, timeout=300, args=(num_calls, 1234 + world_size, "cpu"))
    assert out[0] == out[-1]
    assert out[0]["valid"] + out[0]["invalid"] == num_calls
    assert out[0]["invalid"] > num_calls // 3 and out[0]["valid"] > num_calls // 3
