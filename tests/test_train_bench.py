"""benchmarks/train_bench.py on gloo: two processes train a tiny HF Llama under ddp, zero3 and
pp-1f1b with pynccl and with torch (DDP, FSDP2, torch.distributed.pipelining), and under tp and
tp-sp with both against one process. In fp32 each pair must agree on every step's loss (within the
fp32 rounding of the model's reductions, tests/numerics.py: the two sides run the same math on the
same weights and data, summed in other orders), the losses must fall, and the table, the JSON rows
and the plot must hold one row per (strategy, side). Process-free checks of the flags and layouts
come first."""
import json
import os
import sys

import pytest

pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

import train_bench  # noqa: E402
from train_bench_lib.models import STRATEGIES, Layout, layout_of, parse_strategies, pp_schedule  # noqa: E402
from numerics import transformer_rtol  # noqa: E402

TINY = ["--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
        "--vocab", "128", "--seq", "32", "--batch", "4", "--microbatches", "2", "--warmup", "1", "--steps", "3"]
# The loss, relative: TINY's reduction chain (4 layers, hidden 64, ffn 128, head_dim 16, seq 32,
# vocab 128, 4 × 32 tokens): 5.8e-4. A missed 1/N, a stale shard or a dropped micro-batch moves
# the later steps' losses by percents.
REL = transformer_rtol(4, 64, 128, 16, 32, 128, 4 * 32)


def test_strategies_and_layouts():
    # "all": every pair that runs on any device in any mode (-graphs needs CUDA, tp-sp-async --compile).
    assert parse_strategies("all") == [s for s in STRATEGIES if not s.endswith(("-graphs", "-async"))]
    assert "tp-sp-async" in STRATEGIES and layout_of("tp-sp-async", 2) == Layout(tp=2)
    assert "pp-1f1b-graphs" in STRATEGIES and parse_strategies("pp-1f1b-graphs") == ["pp-1f1b-graphs"]
    assert pp_schedule("pp-1f1b-graphs") == ("1f1b", True) and pp_schedule("pp-interleaved") == ("interleaved", False)
    assert layout_of("pp-gpipe-graphs", 4) == Layout(pp=4)
    assert parse_strategies("zero3, pp-1f1b") == ["zero3", "pp-1f1b"]
    with pytest.raises(ValueError, match="unknown"):
        parse_strategies("zero4")
    assert layout_of("zero2", 4) == Layout(dp=4)
    assert layout_of("tp-sp", 4) == Layout(tp=4)
    assert layout_of("pp-interleaved", 4) == Layout(pp=4)
    assert layout_of("tp2xdp2", 4) == Layout(dp=2, tp=2)
    # tp fastest, as pynccl.ParallelMesh and init_device_mesh(("dp", "tp")).
    assert [Layout(dp=2, tp=2).coords(r) for r in range(4)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    with pytest.raises(ValueError, match="even world size"):
        layout_of("tp2xdp2", 3)


def test_flags_defaults_and_size_errors():
    args = train_bench.parse_args(["--model", "hf-gpt2", "--device", "cpu"])
    assert (args.hidden, args.layers, args.heads, args.vocab, args.seq) == (1024, 24, 16, 50257, 1024)
    assert args.dtype == "fp32"
    args = train_bench.parse_args(["--strategy", "pp-interleaved", "--layers", "4", "--batch", "6",
                                   "--microbatches", "4"])
    assert args.dtype == "bf16" and args.kv_heads == 8
    with pytest.raises(ValueError, match="4 layers cannot fill 8 stages"):
        train_bench.check_sizes(args, "pp-interleaved", 4)
    args.layers = 8
    with pytest.raises(ValueError, match="--batch 6 is not divisible by --microbatches 4"):
        train_bench.check_sizes(args, "pp-interleaved", 4)
    args.batch, args.microbatches = 6, 6
    with pytest.raises(ValueError, match="multiple of pp"):
        train_bench.check_sizes(args, "pp-interleaved", 4)


@pytest.mark.numerics
def test_train_bench_pairs_agree_on_gloo(tmp_path, capfd):
    out, png = tmp_path / "rows.json", tmp_path / "tokens.png"
    train_bench.main(["--device", "cpu", "--nproc", "2", "--strategy", "ddp,zero3,pp-1f1b",
                      "--json", str(out), "--plot", str(png)] + TINY)
    printed = capfd.readouterr().out
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["dtype"] == "fp32" and result["model"] == "hf-llama"
    rows = {(r["strategy"], r["impl"]): r for r in result["rows"]}
    assert list(rows) == [(s, i) for s in ("ddp", "zero3", "pp-1f1b") for i in ("pynccl", "torch")]
    for (strategy, impl), r in rows.items():
        assert not r.get("error"), f"{strategy} {impl}: {r['error']}"
        assert len(r["losses"]) == 4 and r["loss"] == r["losses"][-1]
        assert r["losses"][-1] < r["losses"][0] - 0.05, f"{strategy} {impl} did not train: {r['losses']}"
        assert r["median_ms"] >= r["min_ms"] > 0 and r["tokens_per_s"] > 0 and r["wall_ms"] > 0
    for strategy in ("ddp", "zero3", "pp-1f1b"):
        ours, theirs = rows[(strategy, "pynccl")], rows[(strategy, "torch")]
        for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
            assert abs(a - b) <= REL * abs(b), f"{strategy} step {step}: pynccl loss {a} vs torch {b}"
        assert ours["ms_vs_torch"] == pytest.approx(ours["median_ms"] / theirs["median_ms"])
        assert ours["wall_vs_torch"] == pytest.approx(ours["wall_ms"] / theirs["wall_ms"])
    # DDP and ZeRO-3 see the same two replicas' batches: the same fp32 training.
    for a, b in zip(rows[("ddp", "pynccl")]["losses"], rows[("zero3", "pynccl")]["losses"]):
        assert abs(a - b) <= REL * abs(b)
    assert rows[("ddp", "pynccl")]["layout"] == "dp2" and rows[("pp-1f1b", "torch")]["layout"] == "pp2"
    # The summary table: its header, then one line per row, in order.
    summary = printed[printed.index("# summary"):].splitlines()[2:8]
    expected = ["pynccl DDP", "torch DDP", "pynccl ZeRO-3", "FSDP2 (titan wrap)", "pynccl 1F1B", "pipelining 1F1B"]
    assert [line.split()[0] for line in summary] == ["ddp", "ddp", "zero3", "zero3", "pp-1f1b", "pp-1f1b"]
    assert all(name in line for name, line in zip(expected, summary)), summary
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _single_process_losses(strategy):
    """The reference: the same model, batch and AdamW on one process, no parallelism."""
    import torch
    from train_bench_lib.models import BenchContext, hf_lm_step
    args = train_bench.parse_args(["--device", "cpu"] + TINY)
    ctx = BenchContext(args, torch.device("cpu"), 1, 0, torch.float32)
    model = ctx.build_model(strategy)
    step = hf_lm_step(ctx, model, ctx.optimizer(model.parameters()), ctx.tokens(0), autocast=False)
    return [step().item() for _ in range(args.warmup + args.steps)]


@pytest.mark.numerics
def test_tensor_parallel_plans_train_as_one_process(tmp_path):
    """tp and tp-sp at tp 2, pynccl's plan (plans.llama) and torch's (train_bench's torchtitan-style
    DTensor plan), each against one process: a wrong plan entry (a missed all-reduce, positions
    computed from the local sequence shard) would break the losses."""
    out = tmp_path / "tp.json"
    train_bench.main(["--device", "cpu", "--nproc", "2", "--strategy", "tp,tp-sp", "--impl", "both",
                      "--json", str(out)] + TINY)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["impl"]) for r in rows] == [(s, i) for s in ("tp", "tp-sp") for i in ("pynccl", "torch")]
    expected = _single_process_losses("tp")
    assert expected[-1] < expected[0] - 0.05, f"the reference does not learn: {expected}"
    for r in rows:
        assert not r.get("error"), r.get("error")
        for step, (a, b) in enumerate(zip(r["losses"], expected)):
            assert abs(a - b) <= REL * abs(b), f"{r['strategy']} {r['impl']} step {step}: loss {a} vs one process {b}"


def test_repeats_pool_the_runs():
    """--repeats: step times pooled over the runs (median and min of all), the largest peak, the
    mean wall time, the last run's losses; an error in any run is the row."""
    from train_bench_lib.harness import pool
    runs = [dict(step_ms=[10.0, 30.0], median_ms=20.0, min_ms=10.0, peak_gib=2.0, peak_allocated_gib=1.75,
                 window_gib=0.25, wall_ms=21.0, losses=[3.0, 2.0], loss=2.0, tokens_per_step=1000),
            dict(step_ms=[40.0, 50.0, 60.0], median_ms=50.0, min_ms=40.0, peak_gib=1.5, peak_allocated_gib=1.25,
                 window_gib=0.25, wall_ms=49.0, losses=[3.0, 1.5], loss=1.5, tokens_per_step=1000)]
    row = pool(runs)
    assert (row["median_ms"], row["min_ms"], row["peak_gib"], row["wall_ms"], row["loss"], row["repeats"]) == \
        (40.0, 10.0, 2.0, 35.0, 1.5, 2)
    assert (row["peak_allocated_gib"], row["window_gib"]) == (1.75, 0.25)
    assert row["tokens_per_s"] == pytest.approx(1000 / 0.040)
    assert pool(runs[:1]) is runs[0]
    failed = dict(error="RuntimeError: x")
    assert pool([runs[0], failed]) is failed


def test_peak_includes_symmetric_windows_and_says_so():
    """A row's peak is max_memory_allocated plus the NCCL symmetric windows (outside torch's
    allocator); the summary names the split for rows that hold windows, and only for them."""
    from train_bench_lib.report import window_notes
    rows = [dict(strategy="zero3", impl="pynccl", layout="dp2", peak_gib=23.0, peak_allocated_gib=22.625,
                 window_gib=0.375),
            dict(strategy="zero3", impl="torch", layout="dp2", peak_gib=22.5, peak_allocated_gib=22.5, window_gib=0.0)]
    assert window_notes(rows) == ["# peak of zero3 pynccl ZeRO-3 (eager): 23.00 GiB = 22.62 max_memory_allocated "
                                  "+ 0.38 in NCCL symmetric windows (ncclMemAlloc)"]


def test_grad_ckpt_turns_on_hf_checkpointing_before_wrapping():
    import torch
    from train_bench_lib.models import BenchContext
    for flag in ([], ["--grad-ckpt"]):
        args = train_bench.parse_args(["--device", "cpu"] + TINY + flag)
        model = BenchContext(args, torch.device("cpu"), 1, 0, torch.float32).build_model("zero3")
        assert model.is_gradient_checkpointing == bool(flag)
