"""Tensor parallelism on the NCCL backend, CUDA tensors: every check of test_tensor_parallel.py
(layers, MLP, attention, block, mini GPT, cross-entropy, init, RNG tracker on the CUDA generator)
in fp32 at 1e-5, plus the layers and the mini GPT in bf16 against the bf16 reference; at TP=1 on
one GPU, and at TP=2 where two GPUs exist."""
import pytest
import torch

from pynccl.testing import run_multiprocess
from test_tensor_parallel import check_tensor_parallel

BF16_TOL = dict(rtol=5e-2, atol=5e-2)


def check_fp32_and_bf16(rank, world_size):
    assert check_tensor_parallel(rank, world_size)
    return check_tensor_parallel(rank, world_size, dtype=torch.bfloat16, tol=BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensor_parallel_nccl_tp1():
    assert run_multiprocess(check_fp32_and_bf16, 1, backend="nccl", start_method="spawn", timeout=300) == [True]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_nccl_tp2():
    assert run_multiprocess(check_fp32_and_bf16, 2, backend="nccl", start_method="spawn",
                            timeout=300) == [True, True]
