"""examples/train_llama.py (an unmodified Hugging Face Llama, tensor-parallel by plan, under DDP or
ZeRO over the data axis of a ParallelMesh) at 4 gloo ranks: the losses of 6 AdamW steps equal
the plain single-process model's on the whole batch (fp32, 2e-4 relative) at dp2×tp2 with DDP,
ZeRO-1 and ZeRO-3 (+ sequence parallelism), and tp4 with the logits gathered; the checkpoint
saved from the ZeRO-3 run (TP and ZeRO shards gathered) loads with from_pretrained and holds the
reference's trained weights. One 4-process run trains every layout.
"""
import importlib
import sys
from pathlib import Path

import pytest
import torch

from pynccl.testing import run_multiprocess

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
train_llama = importlib.import_module("train_llama")

STEPS = 6
LOSS_TOL = dict(rtol=2e-4, atol=0.0)
TINY = ["--steps", str(STEPS), "--lr", "1e-2", "--log-every", "0"]
LAYOUTS = {  # name: extra flags (4 processes: dp = 4 / tp)
    "dp2-tp2 DDP": "--tp 2",
    "dp2-tp2 ZeRO-1": "--tp 2 --zero 1",
    "dp2-tp2 ZeRO-3 SP (saves)": "--tp 2 --zero 3 --sequence-parallel --save {tmp}/zero3",
    "tp4 SP, logits gathered": "--tp 4 --sequence-parallel --no-loss-parallel --heads 8 --kv-heads 4",
}


def layout_args(flags: str, tmp: str = ""):
    return train_llama.parse_args(TINY + flags.format(tmp=tmp).split())


def reference(args):
    """The unwrapped model on one process, the whole batch each step: losses and final weights."""
    model = train_llama.build_model(args)
    optimizer = train_llama.make_optimizer(model.parameters(), args)
    losses = []
    for step in range(args.steps):
        x = train_llama.global_batch(args, step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def train_every_layout(rank, world_size, tmp):
    results = {}
    for name, flags in LAYOUTS.items():
        args = layout_args(flags, tmp)
        results[name] = train_llama.train(args)["losses"]
        expected, _ = reference(args)
        torch.testing.assert_close(torch.tensor(results[name]), torch.tensor(expected), **LOSS_TOL,
                                   msg=lambda m, name=name: f"{name}: losses differ from one process: {m}")
    return results


def test_train_llama_layouts_match_one_process(tmp_path):
    results = run_multiprocess(train_every_layout, 4, timeout=600, args=(str(tmp_path),))
    assert all(r == results[0] for r in results), "ranks report different losses"
    args = layout_args(LAYOUTS["dp2-tp2 ZeRO-3 SP (saves)"], str(tmp_path))
    expected_losses, ref = reference(args)
    assert expected_losses[-1] < expected_losses[0] - 0.05, f"the model does not learn: {expected_losses}"
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "zero3")
    ref_params = dict(ref.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=2e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_train_llama_one_process_prints_losses(capsys):
    train_llama.main(["--steps", "2", "--log-every", "1"])
    out = capsys.readouterr().out
    assert "dp1·tp1 on 1 cpu process(es), no data parallelism" in out and "step    1  loss" in out, out
