"""The fuzz driver against the NCCL backend: 10,000 calls at world size 1 on one GPU, and at
world size 2 where two GPUs exist."""
import pytest
import torch

from fuzz_driver import run_fuzz
from pynccl.testing import run_multiprocess


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fuzz_nccl_one_gpu():
    out = run_multiprocess(run_fuzz, 1, backend="nccl", start_method="spawn", timeout=400,
                           args=(10000, 99, "cuda"))
    assert out[0]["valid"] + out[0]["invalid"] == 10000


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fuzz_nccl_two_gpus():
    out = run_multiprocess(run_fuzz, 2, backend="nccl", start_method="spawn", timeout=400,
                           args=(4000, 7, "cuda"))
    assert out[0] == out[1]
