"""examples/train_llama.py (an unmodified Hugging Face Llama, tensor-parallel by plan, under DDP or
ZeRO over the data axis of a ParallelMesh) at 4 gloo ranks: the losses of 6 AdamW steps equal
the plain single-process model's on the whole batch (within the fp32 rounding of the model's
reductions, tests/numerics.py) at dp2×tp2 with DDP,
ZeRO-1 and ZeRO-3 (+ sequence parallelism), tp4 with the logits gathered, and with the pipeline
axis (4 layers): pp4 (1F1B), tp2×pp2 (GPipe, vocabulary-parallel loss) and dp2×pp2 under ZeRO-3;
the checkpoints saved from the dp2×tp2 ZeRO-3 run (TP and ZeRO shards gathered) and from the
tp2×pp2 run (stages gathered too) load with from_pretrained and hold the reference's trained
weights. One 4-process run trains every layout; the combinations pp refuses raise ValueError.
"""
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from pynccl.testing import run_multiprocess
from numerics import assert_within, record_grad_scale, trained_atol, transformer_rtol

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
train_llama = importlib.import_module("train_llama")

STEPS = 6
# The loss and gradients, relative: the example's reduction chain at its largest layout here (4
# layers, hidden 64, ffn 128, head_dim 16, seq 16, vocab 128, 8 × 16 tokens): 5.5e-4. The weights:
# numerics.trained_atol from the reference's AdamW state, element-wise: each weight moves ~6e-2 in
# the 6 steps (lr 1e-2), so a stale stage or shard is far outside; an element whose gradient is
# near zero (Adam's g/sqrt(v) amplifies the summation order of micro-batches and ranks) gets
# Adam's own bound.
RTOL = transformer_rtol(4, 64, 128, 16, 16, 128, 8 * 16)
TINY = ["--steps", str(STEPS), "--lr", "1e-2", "--log-every", "0"]
LAYOUTS = {  # name: extra flags (4 processes: dp = 4 / tp)
    "dp2-tp2 DDP": "--tp 2",
    "dp2-tp2 ZeRO-1": "--tp 2 --zero 1",
    "dp2-tp2 ZeRO-3 SP (saves)": "--tp 2 --zero 3 --sequence-parallel --save {tmp}/zero3",
    "tp4 SP, logits gathered": "--tp 4 --sequence-parallel --no-loss-parallel --heads 8 --kv-heads 4",
    "pp4 1F1B, logits gathered": "--pp 4 --layers 4 --micro-batches 4 --no-loss-parallel",
    "tp2-pp2 GPipe (saves)": "--tp 2 --pp 2 --layers 4 --schedule gpipe --save {tmp}/tp2pp2",
    "dp2-pp2 ZeRO-3 1F1B": "--pp 2 --layers 4 --zero 3 --micro-batches 2",
}
SAVED = ("dp2-tp2 ZeRO-3 SP (saves)", "zero3"), ("tp2-pp2 GPipe (saves)", "tp2pp2")
REFUSED = {"--pp 2 --zero 1": "--zero 1 with --pp 2", "--pp 2 --tp 2 --sequence-parallel": "--sequence-parallel",
           "--pp 2 --micro-batches 3": "--micro-batches"}


def layout_args(flags: str, tmp: str = ""):
    return train_llama.parse_args(TINY + flags.format(tmp=tmp).split())


def reference(args):
    """The unwrapped model on one process, the whole batch each step: losses, the trained model and
    each weight's element-wise bound (numerics.trained_atol)."""
    model = train_llama.build_model(args)
    optimizer = train_llama.make_optimizer(model.parameters(), args)
    losses, scale = [], {}
    for step in range(args.steps):
        x = train_llama.global_batch(args, step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        record_grad_scale(model.parameters(), scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    bounds = {n: trained_atol(optimizer, p, RTOL, scale.get(p), args.steps) for n, p in model.named_parameters()}
    return losses, model, bounds


def train_every_layout(rank, world_size, tmp):
    results = {}
    for name, flags in LAYOUTS.items():
        args = layout_args(flags, tmp)
        results[name] = train_llama.train(args)["losses"]
        expected, _, _ = reference(args)
        torch.testing.assert_close(torch.tensor(results[name]), torch.tensor(expected), rtol=RTOL, atol=0.0,
                                   msg=lambda m, name=name: f"{name}: losses differ from one process: {m}")
        results[name + " max rel diff"] = max(abs(a - b) / abs(b) for a, b in zip(results[name], expected))
    for flags, message in REFUSED.items():
        with pytest.raises(ValueError, match=message):
            train_llama.train(layout_args(flags))
    return results


@pytest.mark.numerics
def test_train_llama_layouts_match_one_process(tmp_path):
    results = run_multiprocess(train_every_layout, 4, timeout=600, args=(str(tmp_path),))
    assert all(r == results[0] for r in results), "ranks report different losses"
    print({name: value for name, value in results[0].items() if name.endswith("diff")})
    for layout, directory in SAVED:
        args = layout_args(LAYOUTS[layout], str(tmp_path))
        expected_losses, ref, bounds = reference(args)
        assert expected_losses[-1] < expected_losses[0] - 0.05, f"the model does not learn: {expected_losses}"
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / directory)
        ref_params = dict(ref.named_parameters())
        assert {n for n, _ in loaded.named_parameters()} == set(ref_params), f"{layout}: saved names differ"
        for name, p in loaded.named_parameters():
            assert_within(p, ref_params[name], bounds[name], f"{layout}, {name}")


def test_train_llama_one_process_prints_losses(capsys):
    """One process, no launcher: the default backend's device (on a GPU host with pynccl._C, CUDA)."""
    from pynccl.comm.backend_names import _default_backend
    device = "cuda" if _default_backend() == "nccl" else "cpu"
    saved = dict(os.environ)
    try:
        train_llama.main(["--steps", "2", "--log-every", "1"])
    finally:        # a plain run sets RANK, WORLD_SIZE, ... as a world of one (examples/launch.py): not for later tests
        os.environ.clear()
        os.environ.update(saved)
    out = capsys.readouterr().out
    assert f"dp1·tp1 on 1 {device} process(es), no data parallelism" in out and "step    1  loss" in out, out
