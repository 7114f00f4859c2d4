"""The backward overlap of tensor parallelism's summed input gradient (pynccl/tensor_parallel/
grad_overlap.py), on Hugging Face models by plan, gloo, TP 2: every gradient equals the plain
path's bit for bit (the same GEMMs on the same tensors, in another order), with and without
sequence parallelism, GPT-2's fused Conv1D q|k|v, activation checkpointing; backward runs, per
block, the collective's start, then the block's weight-gradient GEMMs, then the wait; the overlap
is opt-in (PYNCCL_TP_GRAD_OVERLAP=1) and off where the input needs no gradient."""
import copy
import os

import pytest
import torch

import pynccl.tensor_parallel as tp
from pynccl.tensor_parallel import async_tp, grad_overlap
from pynccl.testing import run_multiprocess

transformers = pytest.importorskip("transformers")

from test_tp_plan import build, gpt2_config, llama_config, tokens  # noqa: E402


def _grads(config, plan, overlap: bool, checkpointing=None):
    """checkpointing: None, or use_reentrant (True: torch's reentrant checkpoint, False: non-reentrant)."""
    os.environ[grad_overlap.ENV] = "1" if overlap else "0"
    os.environ[async_tp.ENV] = "0"   # the plain path, not the default overlap (async_tp_allreduce.py)
    try:
        model = tp.parallelize_module(copy.deepcopy(build(config)), None, plan)
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
            model.train()
        x = tokens()
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    finally:
        os.environ.pop(grad_overlap.ENV, None)
        os.environ.pop(async_tp.ENV, None)


def _counting(log):
    """Wrap the overlap's three backward steps so that each appends its name to `log`."""
    originals = {}
    for cls, tag in ((grad_overlap._StartInputGradCollective, "start"), (grad_overlap._DeferredWeightGrad, "dW"),
                     (grad_overlap._WaitForInputGrad, "wait")):
        original = cls.backward

        def logged(ctx, *grads, original=original, tag=tag):
            # a weight alias gets None from its reader (no zero tensor of the weight's size)
            log.append(tag if tag != "dW" or grads[0] is None else "dW after a materialized zero gradient")
            return original(ctx, *grads)
        originals[cls] = original
        cls.backward = staticmethod(logged)
    return originals


def _equal_to_plain_path(rank, ws):
    cases = [("llama", llama_config(), tp.plans.llama(sequence_parallel=False, loss_parallel=True), None),
             ("llama SP", llama_config(), tp.plans.llama(sequence_parallel=True, loss_parallel=True), None),
             ("llama, reentrant checkpoints", llama_config(), tp.plans.llama(sequence_parallel=False), True),
             ("llama, non-reentrant checkpoints", llama_config(), tp.plans.llama(sequence_parallel=False), False),
             ("gpt2 (Conv1D, fused q|k|v)", gpt2_config(), tp.plans.gpt2(sequence_parallel=False), None),
             ("gpt2 SP", gpt2_config(), tp.plans.gpt2(sequence_parallel=True), None)]
    for what, config, plan, ckpt in cases:
        log = []
        originals = _counting(log)
        try:
            loss_on, on = _grads(config, plan, True, ckpt)
            blocks_on = log.count("start")
            log.clear()
            loss_off, off = _grads(config, plan, False, ckpt)
            assert log == [], f"{what}: PYNCCL_TP_GRAD_OVERLAP=0 still took the overlap: {log}"
        finally:
            for cls, original in originals.items():
                cls.backward = staticmethod(original)
        # 2 layers x (attention + MLP), each block's input summed once (recomputed: once more per block)
        assert blocks_on == 4, f"{what}: {blocks_on} overlapped collectives, expected one per block (4)"
        assert torch.equal(loss_on, loss_off), what
        for name, g in off.items():
            assert (on[name] is None) == (g is None), f"{what}: {name} has a grad on one path only"
            if g is not None:
                assert torch.equal(on[name], g), f"{what}: {name}'s grad differs from the plain path's " \
                    f"(max |diff| {(on[name] - g).abs().max().item():.3g})"
    return True


def _backward_order(rank, ws):
    """Per block: the collective starts, then the block's column-parallel weight GEMMs (2 in the
    MLP: gate, up; 3 in attention: q, k, v), then the compute stream waits for the collective."""
    log = []
    originals = _counting(log)
    try:
        _grads(llama_config(), tp.plans.llama(sequence_parallel=False), True)
    finally:
        for cls, original in originals.items():
            cls.backward = staticmethod(original)
    mlp, attention = ["start", "dW", "dW", "wait"], ["start", "dW", "dW", "dW", "wait"]
    assert log == (mlp + attention) * 2, log     # backward: layer 1's MLP, its attention, then layer 0's
    return True


def _off_without_input_grad(rank, ws):
    """A block input that needs no gradient (layer 0's attention input, with the embedding and that
    layer's input norm frozen) takes the plain path there, and the weights still get theirs."""
    log = []
    originals = _counting(log)
    os.environ[grad_overlap.ENV] = "1"
    try:
        model = tp.parallelize_module(build(llama_config()), None, tp.plans.llama())
        model.model.embed_tokens.weight.requires_grad_(False)
        model.model.layers[0].input_layernorm.weight.requires_grad_(False)
        x = tokens()
        model(input_ids=x, labels=x).loss.backward()
    finally:
        os.environ.pop(grad_overlap.ENV, None)
        for cls, original in originals.items():
            cls.backward = staticmethod(original)
    # layer 0's attention input (the frozen embedding's output) needs no grad: 3 of 4 blocks overlap
    assert log.count("start") == 3, log
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    return True


def test_overlap_equals_the_plain_path_bit_for_bit():
    assert run_multiprocess(_equal_to_plain_path, 2, backend="gloo", timeout=240) == [True, True]


def test_backward_runs_the_weight_gemms_between_start_and_wait():
    assert run_multiprocess(_backward_order, 2, backend="gloo", timeout=120) == [True, True]


def test_off_where_the_block_input_needs_no_gradient():
    assert run_multiprocess(_off_without_input_grad, 2, backend="gloo", timeout=120) == [True, True]


def test_switch_is_checked_and_off_by_default(monkeypatch):
    monkeypatch.delenv(grad_overlap.ENV, raising=False)
    assert not grad_overlap.enabled()          # opt-in: slower than the plain path on 2xH100 (RESULTS)
    monkeypatch.setenv(grad_overlap.ENV, "1")
    assert grad_overlap.enabled()
    monkeypatch.setenv(grad_overlap.ENV, "yes")
    with pytest.raises(ValueError, match="PYNCCL_TP_GRAD_OVERLAP must be 0 or 1"):
        grad_overlap.enabled()
    monkeypatch.setenv(grad_overlap.ENV, "0")
    assert not grad_overlap.enabled()
