"""benchmarks/tp_rank_floor.py: the model it times as one tensor-parallel rank's compute has exactly
the parameter shapes of a rank of pynccl's plans.llama() (gloo, tp 2, by name), so its step is what
that rank computes with no communication; with --sequence-parallel every norm, attention and MLP
block and the LM head see the shapes a rank of plans.llama(sequence_parallel=True) sees, with
--sequence-dim 0 those of the batch split's rank; sizes that do not divide and a --sequence-dim
without --sequence-parallel are refused; the script runs end to end (CPU, a tiny model) and prints
each mode's ratio."""
import os
import re
import subprocess
import sys

import pytest
import torch

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.testing import run_multiprocess

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import tp_rank_floor  # noqa: E402

from test_tp_plan import llama_config  # noqa: E402


def _rank_shapes(rank, world):
    config = llama_config(use_cache=False)
    model = tp.parallelize_module(transformers.LlamaForCausalLM(config), pynccl.get_default_group(), tp.plans.llama())
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_rank_model_has_a_tp_ranks_parameter_shapes():
    sharded = run_multiprocess(_rank_shapes, 2, timeout=180)
    config = llama_config(use_cache=False)
    own = {name: tuple(p.shape) for name, p in
           transformers.LlamaForCausalLM(tp_rank_floor.rank_config(config, 2)).named_parameters()}
    whole = {name: tuple(p.shape) for name, p in transformers.LlamaForCausalLM(config).named_parameters()}
    assert sharded[0] == sharded[1] == own, {k: (sharded[0].get(k), own.get(k)) for k in own if sharded[0].get(k) != own[k]}
    assert own != whole and sum(torch.Size(s).numel() for s in own.values()) < sum(
        torch.Size(s).numel() for s in whole.values())


def _recorded_shapes(model):
    """Runs one forward and backward of the tiny Llama; returns (module, 'in' | 'out', shape) for every
    norm, attention and MLP block and the LM head's output, as hooks registered last see them (the SP
    plan's LM head gathers its input inside its forward, the emulation in a pre-hook: its output
    shows both)."""
    seen = []

    def first(t):
        return t[0] if isinstance(t, tuple) else t
    for name, mod in model.named_modules():
        if name.endswith(("layernorm", "self_attn", "mlp")) or name in ("model.norm", "lm_head"):
            if name == "lm_head":
                mod.register_forward_hook(lambda m, a, o: seen.append(("lm_head", "out", tuple(o.shape))))
                continue
            mod.register_forward_pre_hook(lambda m, a, k, name=name: seen.append(
                (name, "in", tuple(first(a).shape if a else k["hidden_states"].shape))), with_kwargs=True)
            mod.register_forward_hook(lambda m, a, o, name=name: seen.append((name, "out", tuple(first(o).shape))))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))   # ids the rank model has too
    model(input_ids=x, labels=x).loss.backward()
    return seen


def _sp_rank_shapes(rank, world, sequence_dim=1):
    model = tp.parallelize_module(transformers.LlamaForCausalLM(llama_config(use_cache=False)),
                                  pynccl.get_default_group(),
                                  tp.plans.llama(sequence_parallel=True, sequence_dim=sequence_dim))
    return _recorded_shapes(model)


def test_sequence_parallel_emulation_has_an_sp_ranks_shapes():
    """The norms and residuals on 4 of 8 tokens, each block's input whole and its output the shard,
    the logits whole in the sequence and half the vocabulary: as a gloo rank of the SP plan."""
    real = run_multiprocess(_sp_rank_shapes, 2, timeout=180)
    model = transformers.LlamaForCausalLM(tp_rank_floor.rank_config(llama_config(use_cache=False), 2))
    tp_rank_floor.sequence_parallel_hooks(model, 2)
    emulated = _recorded_shapes(model)
    assert real[0] == real[1] == emulated, [(r, e) for r, e in zip(real[0], emulated) if r != e]
    assert ("model.layers.0.input_layernorm", "in", (2, 4, 64)) in emulated
    assert ("model.layers.0.mlp", "in", (2, 8, 64)) in emulated and ("lm_head", "out", (2, 8, 64)) in emulated


def test_batch_split_emulation_has_a_batch_split_ranks_shapes():
    """sequence_dim=0: the norms and residuals on 1 of 2 sequences, whole in length; each block's input
    both sequences, its output this rank's one; the logits both sequences, half the vocabulary."""
    real = run_multiprocess(_sp_rank_shapes, 2, args=(0,), timeout=180)
    model = transformers.LlamaForCausalLM(tp_rank_floor.rank_config(llama_config(use_cache=False), 2))
    tp_rank_floor.sequence_parallel_hooks(model, 2, sequence_dim=0)
    emulated = _recorded_shapes(model)
    assert real[0] == real[1] == emulated, [(r, e) for r, e in zip(real[0], emulated) if r != e]
    assert ("model.layers.0.input_layernorm", "in", (1, 8, 64)) in emulated
    assert ("model.layers.0.mlp", "in", (2, 8, 64)) in emulated
    assert ("model.layers.0.mlp", "out", (1, 8, 64)) in emulated
    assert ("lm_head", "out", (2, 8, 64)) in emulated


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) does not divide by tp \(4\)"):
        tp_rank_floor.rank_config(llama_config(heads=4, kv_heads=2), 4)


@pytest.mark.parametrize("argv, message", [
    (["--sequence-parallel", "--sequence-dim", "0", "--batch", "3"], r"--batch \(3\) must divide by --tp \(2\)"),
    (["--sequence-dim", "0"], "it needs --sequence-parallel")])
def test_bad_sequence_dim_flags_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        tp_rank_floor.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_script_runs_and_prints_each_modes_ratio():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tp_rank_floor.py"), "--device", "cpu",
                          "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
                          "--vocab", "128", "--seq", "16", "--batch", "2", "--modes", "eager", "--steps", "2",
                          "--warmup", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "a tp 2 rank keeps 2 heads, 1 KV heads, intermediate 64, vocabulary 64" in out.stdout, out.stdout
    line = re.search(r"^eager: one GPU ([\d.]+) ms, a tp 2 rank's compute ([\d.]+) ms = ([\d.]+)$", out.stdout, re.M)
    assert line and float(line[1]) > 0 and float(line[2]) > 0, out.stdout
    assert abs(float(line[3]) - float(line[2]) / float(line[1])) < 1e-3 + 1e-3 * float(line[3]), line[0]
