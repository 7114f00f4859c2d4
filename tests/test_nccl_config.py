"""The communicator's ncclConfig_t limits are checked before NCCL sees them (session 15): NCCL
2.28.9 rejects minCTAs without maxCTAs, and a split rejected that way leaves its parent holding
freed memory (a process crashed at exit on 4xH100). Both ways in are covered: NcclOptions (no GPU
needed: the check comes before the communicator is made) and the PYNCCL_NCCL_* overrides, read
in C++ at every init and split."""
import os

import pytest
import torch

from pynccl.comm.backends.nccl import NcclBackend
from nccl_single_gpu_common import GPU_MARKS, new_comm


@pytest.mark.parametrize("limits, message", [
    (dict(min_ctas=16), "NcclOptions.min_ctas=16 needs max_ctas as well: NCCL rejects one without the other"),
    (dict(min_ctas=8, max_ctas=4), "NcclOptions.min_ctas=8 is above max_ctas=4"),
])
def test_nccl_options_cta_limits_are_checked_first(limits, message):
    with pytest.raises(ValueError, match=message):
        NcclBackend.create(bytes(128), 2, 0, 0, **limits)


@pytest.mark.parametrize("env, message", [
    ({"PYNCCL_NCCL_MIN_CTAS": "16"}, r"minCTAs 16 \(min_ctas= or PYNCCL_NCCL_MIN_CTAS\) needs maxCTAs as well"),
    ({"PYNCCL_NCCL_MIN_CTAS": "16", "PYNCCL_NCCL_MAX_CTAS": "8"}, "minCTAs 16 is above maxCTAs 8"),
])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_env_cta_limits_are_checked_before_init_and_split(env, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        new_comm("bad_limits", **env)
    parent = new_comm("parent")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        parent.split(0, 0)
    for k in env:
        monkeypatch.delenv(k)
    # the parent is untouched: it still reduces, splits and is destroyed cleanly
    x = torch.ones(4, device="cuda")
    parent.all_reduce(x)
    child = parent.split(0, 0)
    child.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.ones(4, device="cuda"))
    child.destroy()
    parent.destroy()
