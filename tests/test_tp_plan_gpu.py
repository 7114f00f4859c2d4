"""Tensor parallelism by plan on the NCCL backend, CUDA tensors: every plan check of
test_tp_plan.py (Llama with grouped-query attention, GPT-2, with and without sequence
parallelism and the vocabulary-parallel loss) in fp32 within test_tp_plan's bounds and in bf16
against the bf16 unsharded model (loss within 2e-2 relative, logits and each grad within 3e-2 of
its norm, see BF16_REL), at TP 2 (2 GPUs) and TP 4 (4 GPUs); and
examples/train_llama.py's layouts against one CPU process (4 GPUs).
"""
import pytest
import torch

from pynccl.testing import run_multiprocess

pytest.importorskip("transformers")
from test_tp_plan import FP32_TOL, plan_checks  # noqa: E402

# bf16, norm-wise: GEMMs accumulate in fp32 and each op's output is rounded to bf16 (u = 2^-8) on
# each side; independent roundings along a path of n ops grow as sqrt(n)·u norm-wise (Higham and
# Mary, SIAM J. Sci. Comput. 2019, the probabilistic bound), n ≈ 2 layers × ~20 ops forward and
# backward + the head and loss ≈ 48: sqrt(48) × 2^-8 = 2.7e-2 -> 3e-2. A missed all-reduce is
# off by 1 - 1/tp of the value.
BF16_REL = 3e-2


def _close_bf16(actual, expected, what, tol):
    assert actual is not None, f"{what}: no gradient"
    actual, expected = actual.float(), expected.float().to(actual.device)
    if actual.dim() == 0:
        assert torch.isclose(actual, expected, rtol=2e-2, atol=0), f"{what}: {actual.item()} vs {expected.item()}"
        return
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-6)
    assert err < BF16_REL, f"{what}: relative error {err.item():.3g} >= {BF16_REL} (bf16)"


def check_plans_nccl(rank, world_size):
    import pynccl
    group = pynccl.get_default_group()
    dev = pynccl.get_device(group)
    heads, kv = (8, 4) if world_size == 4 else (4, 2)
    plan_checks(group, heads, kv, device=dev, dtype=torch.float32, tol=FP32_TOL)
    plan_checks(group, heads, kv, device=dev, dtype=torch.bfloat16, close=_close_bf16)
    return True


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp_plans_nccl_tp2():
    assert run_multiprocess(check_plans_nccl, 2, backend="nccl", start_method="spawn", timeout=600) == [True] * 2


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_tp_plans_nccl_tp4():
    assert run_multiprocess(check_plans_nccl, 4, backend="nccl", start_method="spawn", timeout=600) == [True] * 4


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_train_llama_nccl_layouts_match_one_process(tmp_path):
    from test_train_llama import train_every_layout
    results = run_multiprocess(train_every_layout, 4, backend="nccl", start_method="spawn", timeout=600,
                               args=(str(tmp_path),))
    assert all(r == results[0] for r in results)
