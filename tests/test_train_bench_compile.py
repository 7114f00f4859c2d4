"""train_bench's MFU formula, its GPU peak table, its loss checks, and --compile on gloo: every pair
built compiled the way its library's users compile it (aot_eager here: dynamo and AOT autograd,
where the wrappers meet the compiler, without inductor's C++ build) and against its fair torch
counterpart (DDP + ZeroRedundancyOptimizer for ZeRO-1, FSDP2 unresharded for ZeRO-2, FSDP2 as
torchtitan wraps it for ZeRO-3). In fp32 every compiled and eager row, of either side, trains as
one process does (1e-4 relative per step, as test_train_bench)."""
import json
import os
import sys

import pytest

pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import torch  # noqa: E402
import transformers  # noqa: E402

import train_bench  # noqa: E402
from train_bench_lib import mfu, report  # noqa: E402
from test_train_bench import REL, TINY, _single_process_losses  # noqa: E402


# ------------------------------------------------------------------------------------------ MFU
def _llama(tied=False, **kw):
    cfg = dict(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=3, num_attention_heads=8,
               num_key_value_heads=2, tie_word_embeddings=tied, use_cache=False)
    cfg.update(kw)
    return transformers.LlamaConfig(**cfg)


def test_flops_per_token_counts_matmul_params_by_hand():
    """6·N + 12·L·H·D·T, N counted by hand from the shapes: per layer q and o (h·h), k and v
    (h·kv·d each), the MLP (3·h·ffn), two norms (h); the final norm; the head (V·h) but not the
    embedding table. Tied, the table is the head's weight and counts once."""
    V, h, ffn, L, H, kv, T = 1000, 256, 704, 3, 8, 2, 128
    d = h // H
    layer = 2 * h * h + 2 * h * kv * d + 3 * h * ffn + 2 * h
    untied = L * layer + h + V * h
    assert mfu.hf_flops_per_token(_llama(), T) == 6 * untied + 12 * L * H * d * T
    assert mfu.hf_flops_per_token(_llama(tied=True), T) == 6 * untied + 12 * L * H * d * T
    # GPT-2 (tied wte/lm_head, a position table that is no matmul): 12·h² + 4h biases... counted
    # from the module itself, less wpe; the tied table counts once, as the head.
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=h, n_layer=L, n_head=H, n_positions=T)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert mfu.matmul_params(model) == total - T * h
    assert mfu.hf_flops_per_token(cfg, T) == 6 * (total - T * h) + 12 * L * H * d * T


def test_flops_per_token_matches_torchtitan_llama3_8b():
    """Llama 3 8B at seq 8192, where torchtitan's get_dense_model_nparams_and_flops gives
    6 · (8,030,261,248 − 525,336,576) + 6 · 32 · 32 · (2 · 128) · 8192 flops per token."""
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   tie_word_embeddings=False, use_cache=False)
    assert mfu.hf_flops_per_token(cfg, 8192) == 6 * (8_030_261_248 - 525_336_576) + 6 * 32 * 32 * 256 * 8192


def test_nanogpt_head_is_found_without_get_output_embeddings():
    from nanogpt import model as nanogpt_model
    cfg = nanogpt_model.GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64, bias=False)
    with torch.device("meta"):
        model = nanogpt_model.GPT(cfg)
    total = sum(p.numel() for p in model.parameters())          # wte counted once (tied to lm_head)
    assert mfu.matmul_params(model) == total - 64 * 64          # all but the position table


def test_peak_table_by_device_name():
    assert mfu.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert mfu.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert mfu.peak_bf16_flops("NVIDIA H100 NVL") == 835e12
    assert mfu.peak_bf16_flops("NVIDIA H200") == 989e12
    assert mfu.peak_bf16_flops("NVIDIA H20") == 148e12
    assert mfu.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert mfu.peak_bf16_flops("NVIDIA GeForce RTX 4090") is None
    assert mfu.mfu(1000, 2.0, None) is None
    assert mfu.mfu(7e9, 50_000, 989e12) == pytest.approx(7e9 * 5e4 / 989e12)


# ------------------------------------------------------------------------------------------ checks
def test_loss_problems_pair_modes_and_sides():
    rows = [dict(strategy="zero3", impl="pynccl", compiled=False, loss=2.00),
            dict(strategy="zero3", impl="torch", compiled=False, loss=2.01),
            dict(strategy="zero3", impl="pynccl", compiled=True, loss=2.10),      # 5 % off its eager run
            dict(strategy="zero3", impl="torch", compiled=True, loss=2.011),
            dict(strategy="ddp", impl="pynccl", compiled=True, error="boom"),
            dict(strategy="ddp", impl="torch", compiled=True, loss=3.0)]
    problems = report.loss_problems(rows, 0.02)
    assert len(problems) == 2, problems
    assert all(p.startswith("zero3: pynccl compiled loss 2.1000") for p in problems)
    assert "vs torch compiled 2.0110" in problems[0] and "vs pynccl eager 2.0000" in problems[1]
    assert report.loss_problems(rows, 0.06) == []


def test_row_names_say_what_runs():
    assert report.runs_as("zero1", "torch") == "DDP + ZeroRedundancyOpt"
    assert report.runs_as("zero2", "torch") == "FSDP2 no reshard (titan)"
    assert report.runs_as("tp", "torch", "1") == report.ONE_GPU_TORCH
    assert report.runs_as("tp", "torch", "tp2") == "DTensor TP"


# ------------------------------------------------------------------------------------------ runs
def _rows(tmp_path, argv):
    out = tmp_path / "rows.json"
    train_bench.main(["--device", "cpu", "--json", str(out), "--compile-backend", "aot_eager"] + argv + TINY)
    return json.loads(out.read_text())


def test_compiled_and_eager_pairs_train_as_one_process(tmp_path, capfd):
    """ddp, zero1-3 and tp-sp, eager and compiled, both sides: the losses of every step equal one
    process's; compiled rows name their recipe and report their graph breaks (none for these:
    DDP's bookkeeping and ZeRO's hooks stay out of the graphs, the blocks compile whole)."""
    strategies = ["ddp", "zero1", "zero2", "zero3", "tp-sp"]
    result = _rows(tmp_path, ["--nproc", "2", "--strategy", ",".join(strategies), "--compile", "both"])
    printed = capfd.readouterr().out
    rows = {(r["strategy"], r["impl"], r["compiled"]): r for r in result["rows"]}
    assert len(rows) == 4 * len(strategies)
    # Data parallelism (two replicas, their own batches): torch DDP's eager losses; TP: one process.
    expected = {"dp": rows[("ddp", "torch", False)]["losses"], "tp-sp": _single_process_losses("tp")}
    assert expected["dp"][-1] < expected["dp"][0] - 0.05
    recipes = {"ddp": "compile(model)", "zero1": "compile(model)", "zero2": "compile(blocks)",
               "zero3": "compile(blocks)", "tp-sp": "compile(blocks)"}
    for (strategy, impl, compiled), r in rows.items():
        assert not r.get("error"), f"{strategy} {impl} compiled={compiled}: {r['error']}"
        ref = expected["tp-sp" if strategy == "tp-sp" else "dp"]
        for step, (a, b) in enumerate(zip(r["losses"], ref)):
            assert abs(a - b) <= REL * abs(b), f"{strategy} {impl} compiled={compiled} step {step}: {a} vs {b}"
        assert r["recipe"] == (recipes[strategy] if compiled else "eager")
        assert r["tokens_per_s_gpu"] == pytest.approx(r["tokens_per_s"] / 2) and r["mfu"] is None
        if compiled:
            assert r["graphs"] >= 1, r
            if strategy != "tp-sp" or impl == "torch":           # pynccl TP breaks at its collectives
                assert r["graph_breaks"] == 0, (strategy, impl, r["graph_breaks"])
        else:
            assert "graph_breaks" not in r
    for strategy in strategies:
        for compiled in (False, True):
            ours, theirs = rows[(strategy, "pynccl", compiled)], rows[(strategy, "torch", compiled)]
            assert ours["ms_vs_torch"] == pytest.approx(ours["median_ms"] / theirs["median_ms"])
    assert rows[("zero1", "torch", False)]["runs"] == "DDP + ZeroRedundancyOpt"
    assert "PROBLEM" not in printed
    assert result["compile"] == "both" and result["flops_per_token"] > 0 and result["peak_bf16_flops"] is None


def test_one_gpu_tp_reference_is_the_plain_model(tmp_path):
    """tp at world size 1: torch's side is the unwrapped model (no DTensor on a 1-rank mesh), the
    reference of TP scaling; both sides train as one process, eager and compiled."""
    result = _rows(tmp_path, ["--nproc", "1", "--strategy", "tp", "--compile", "both"])
    expected = _single_process_losses("tp")
    for r in result["rows"]:
        assert not r.get("error"), r["error"]
        assert r["runs"] == (report.ONE_GPU_TORCH if r["impl"] == "torch" else "pynccl TP")
        for a, b in zip(r["losses"], expected):
            assert abs(a - b) <= REL * abs(b)


def test_compile_mode_reaches_torch_compile_and_needs_inductor(capsys):
    """--compile-mode goes to torch.compile as its mode (none for the default: torch's own), and only
    with inductor, whose modes they are (another backend would ignore it, with a warning only)."""
    from train_bench_lib import compile_recipes as cr
    assert cr._options("inductor", "reduce-overhead") == dict(backend="inductor", mode="reduce-overhead")
    assert cr._options("aot_eager", "default") == dict(backend="aot_eager")
    assert cr._options("aot_eager", None) == dict(backend="aot_eager")
    with pytest.raises(SystemExit):
        train_bench.parse_args(["--compile", "--compile-mode", "reduce-overhead", "--compile-backend", "aot_eager"])
    assert "needs --compile-backend inductor" in capsys.readouterr().err


def test_async_tp_needs_compile_and_cuda(tmp_path):
    result = _rows(tmp_path, ["--nproc", "2", "--strategy", "tp-sp-async", "--impl", "torch"])
    assert "run it with --compile" in result["rows"][0]["error"]
    result = _rows(tmp_path, ["--nproc", "2", "--strategy", "tp-sp-async", "--impl", "torch", "--compile"])
    assert "needs CUDA" in result["rows"][0]["error"]


def test_tp_scaling_against_the_one_gpu_run(tmp_path, capsys):
    """train_bench_summary: every tp row over the one-GPU plain model of the same shape and mode,
    from another file of the same run directory; rows of another shape or mode are not compared."""
    import train_bench_summary

    def row(strategy, impl, layout, ms, compiled=False):
        return dict(strategy=strategy, impl=impl, layout=layout, median_ms=ms, min_ms=ms, tokens_per_s=1.0,
                    peak_gib=None, loss=2.0, compiled=compiled, recipe="eager")
    head = dict(world_size=2, device="cpu", torch="t", torch_nccl="n", nccl_runtime="n", transformers="x",
                model="hf-llama", hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=128, seq=32,
                batch=4, dtype="bf16")
    (tmp_path / "a_tp2.json").write_text(json.dumps(dict(head, rows=[
        row("tp", "pynccl", "tp2", 60.0), row("tp", "torch", "tp2", 90.0), row("tp", "pynccl", "tp2", 50.0, True)])))
    (tmp_path / "b_1gpu.json").write_text(json.dumps(dict(head, world_size=1, rows=[
        row("tp", "pynccl", "1", 100.0), row("tp", "torch", "1", 100.0)])))
    (tmp_path / "c_other.json").write_text(json.dumps(dict(head, batch=8, rows=[row("tp", "torch", "1", 10.0)])))
    # a --floor run of the same shape: its pair has its scaling from its own floor, reported once, by the floor lines
    (tmp_path / "d_floor.json").write_text(json.dumps(dict(head, seq=64, rows=[
        dict(row("tp", "pynccl", "tp2", 70.0), scaling=0.7, floor_ms=100.0),
        dict(row("tp", "torch", "tp2", 80.0), scaling=0.8, floor_ms=100.0),
        dict(row("tp", "plain", "1", 100.0), floor=True)])))
    assert train_bench_summary.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum("scaling (step / one-GPU step" in ln for ln in out) == 1, out
    lines = [ln for ln in out if ln.startswith("TP scaling")]
    assert len(lines) == 2, lines                       # the compiled row has no compiled one-GPU reference
    assert "pynccl TP (eager) at tp 2: 60.00 ms = 0.600 x the one-GPU 100.00 ms (b_1gpu); efficiency 83%" in lines[0]
    assert "DTensor TP (eager) at tp 2: 90.00 ms = 0.900 x" in lines[1]
