"""Hugging Face generate() on ZeRO over NCCL, on CUDA (test_zero3_generate.py runs the same checks on
gloo): greedy token ids of model.generate / model.module.generate equal the unwrapped model's with the
same weights on the same GPU, with and without the KV cache, before and after an optimizer step; the
logits of a decode loop and of a plain forward are within the reduction-order bound of the unwrapped
model's (a gathered parameter lives in a flat buffer, so cuBLAS may pick another kernel than for the
plain model's own tensor); stage 3 leaves every parameter a placeholder after. With 2+ GPUs ranks also
generate different numbers of tokens (synced_gpus). World size = the GPUs present (1 on one GPU)."""
import pytest
import torch

import pynccl
from pynccl import _ext
from pynccl.testing import run_multiprocess

from numerics import max_rel_diff, transformer_rtol
from test_zero3_generate import check_generate, plain_with, prompt
from test_zero_real_clients import BATCH, SEQ, VOCAB, batch, local, make_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not _ext.available(), reason="pynccl._C not built")]

# the tiny models: 3 layers, hidden 32, intermediate 64 (GPT-2's 128 taken), head dim 8; transformer_rtol
# counts forward and backward, the logits only the forward: half of it
LOGITS_RTOL = transformer_rtol(3, 32, 128, 8, SEQ, VOCAB, 1) / 2


def check_on_gpu(model, kind, device):
    """check_generate with the logits within LOGITS_RTOL; returns the largest relative difference seen."""
    diffs = []

    def within(got, expected):
        diffs.append(max_rel_diff(got, expected))
        return diffs[-1] <= LOGITS_RTOL
    check_generate(model, kind, device, within)
    return max(diffs)


def _case(rank, ws):
    device = torch.device("cuda", rank)
    assert pynccl.get_backend() == "nccl"
    diffs = {}
    for kind in ("gpt2", "llama"):
        for stage in (3, 1):
            model = pynccl.FullyShardedDataParallel(make_model(kind).to(device), stage=stage)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            diffs[f"{kind} stage {stage} before"] = check_on_gpu(model, kind, device)
            x = local(batch(0), rank, ws).to(device)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            diffs[f"{kind} stage {stage} after"] = check_on_gpu(model, kind, device)
    if ws > 1:                                        # ranks done after different numbers of tokens
        model = pynccl.FullyShardedDataParallel(make_model("llama").to(device), stage=3)
        plain, x = plain_with(model, "llama", device), prompt(device)
        n = 2 + 3 * rank
        got = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
        expected = plain.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
        assert torch.equal(got, expected), (rank, got, expected)
    return diffs


def test_generate_on_nccl_equals_the_unwrapped_model():
    ws = torch.cuda.device_count()
    assert BATCH % ws == 0 or ws > BATCH, ws
    ws = min(ws, BATCH)
    diffs = run_multiprocess(_case, ws, backend="nccl", timeout=300)
    print(f"world size {ws}, largest relative logit difference per case (bound {LOGITS_RTOL:.2e}):", diffs[0])
