"""Tensor parallelism on the NCCL backend, CUDA tensors: every check of test_tensor_parallel.py
(layers, MLP, attention, block, mini GPT, cross-entropy, init, RNG tracker on the CUDA generator)
in fp32 within its bounds (FP32_TOL), plus the layers and the mini GPT in bf16 against the bf16
reference; at TP=1 on one GPU, and at TP=2 where two GPUs exist."""
import pytest
import torch

from pynccl.testing import run_multiprocess
from test_tensor_parallel import check_tensor_parallel

# bf16, relative to each tensor's largest element: GEMMs accumulate in fp32, but every op's output
# is rounded to bf16 on each side, and two roundings of nearby values may land one ulp (eps(bf16))
# apart; such differences add along the mini GPT's longest path, ~28 ops forward and backward
# (per block: 2 norms, qkv, attention, proj, fc, GELU, proj, 2 residual adds; the embedding, final
# norm, logits and loss): 28 × 2^-7 = 0.22. A missed all-reduce is off by 1 - 1/tp of the value.
BF16_TOL = 28 * torch.finfo(torch.bfloat16).eps


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
