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
    with pytest.raises(SystemExit):   # argparse's error: the dump is of the profiled steps
        train_bench.parse_args(["--profile-dump", "/tmp/k"])
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
    args = train_bench.parse_args(["--strategy", "tp-sp", "--sp-dim", "0", "--batch", "6"])
    train_bench.check_sizes(args, "tp-sp", 2)
    with pytest.raises(ValueError, match=r"--sp-dim 0: --batch 6 is not divisible by tp \(4\)"):
        train_bench.check_sizes(args, "tp-sp", 4)
    args.sp_dim = 1
    train_bench.check_sizes(args, "tp-sp", 4)        # the sequence split checks the sequence, at its forward


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    """--plot needs matplotlib: said at parse time, not after a run of many minutes."""
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(SystemExit):
        train_bench.parse_args(["--device", "cpu", "--plot", "/tmp/x.png"])
    assert "--plot needs matplotlib" in capsys.readouterr().err


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
    # pynccl's sequence parallelism split along the batch instead (--sp-dim 0, plans.llama's sequence_dim=0)
    train_bench.main(["--device", "cpu", "--nproc", "2", "--strategy", "tp-sp", "--impl", "pynccl", "--sp-dim", "0",
                      "--json", str(out)] + TINY)
    batch_split = json.loads(out.read_text())
    assert batch_split["sp_dim"] == 0
    rows += batch_split["rows"]
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


def _printed_medians(summary: str) -> dict:
    """(strategy, runs column, layout) -> the median ms the summary table printed."""
    import re
    out = {}
    for line in summary.splitlines():
        m = re.match(r"^(\S+)\s+(.+?)\s{2,}(eager|compile\(\w+\))\s+(\S+)\s+[\d,]+\s+[\d,]+\s+\S+\s+([\d.]+)\s", line)
        if m:
            out[(m[1], m[2], m[3], m[4])] = float(m[5])
    return out


@pytest.mark.numerics
def test_floor_rows_train_as_one_process_and_the_summary_divides_the_printed_numbers(tmp_path, capfd):
    """--floor: after each pair, rank 0 alone trains the floor at world size 1 (zero3: each side's own
    wrapper over a 1-rank group; tp: the plain model, the one-GPU step). In fp32 a floor trains rank
    0's batch exactly as one process does (same math, at most other summation orders: REL); the
    summary's floor, costs, cost ratio and scaling are the printed rows' numbers, to their rounding."""
    import re
    out = tmp_path / "floor.json"
    train_bench.main(["--device", "cpu", "--nproc", "2", "--strategy", "zero3,tp", "--floor", "--json", str(out)]
                     + TINY)
    printed = capfd.readouterr().out
    result = json.loads(out.read_text())
    assert result["floor"] is True
    rows = result["rows"]
    assert [(r["strategy"], r["impl"], r["layout"], bool(r.get("floor"))) for r in rows] == [
        ("zero3", "pynccl", "dp2", False), ("zero3", "torch", "dp2", False), ("zero3", "pynccl", "1", True),
        ("zero3", "torch", "1", True), ("tp", "pynccl", "tp2", False), ("tp", "torch", "tp2", False),
        ("tp", "plain", "1", True)]
    expected = _single_process_losses("zero3")
    for r in rows:
        assert not r.get("error"), f"{r['strategy']} {r['impl']}: {r['error']}"
        if r.get("floor"):
            assert r["tokens_per_step"] == 4 * 32 and r["tokens_per_s_gpu"] == r["tokens_per_s"]
            for step, (a, b) in enumerate(zip(r["losses"], expected)):
                assert abs(a - b) <= REL * abs(b), f"{r['strategy']} {r['impl']} floor step {step}: {a} vs {b}"
    assert [r["runs"] for r in rows if r.get("floor")] == ["pynccl ZeRO-3", "FSDP2 (titan wrap)",
                                                             "plain model (1 GPU)"]
    pairs = {(r["strategy"], r["impl"]): r for r in rows if not r.get("floor")}
    floors = {(r["strategy"], r["impl"]): r for r in rows if r.get("floor")}
    # The JSON: each pair row against its own side's floor (zero3) or the shared plain model (tp).
    for impl in ("pynccl", "torch"):
        z, f = pairs[("zero3", impl)], floors[("zero3", impl)]
        assert (z["floor_ms"], z["cost_over_floor_ms"]) == (f["median_ms"], z["median_ms"] - f["median_ms"])
        t, one = pairs[("tp", impl)], floors[("tp", "plain")]
        assert (t["floor_ms"], t["scaling"]) == (one["median_ms"], t["median_ms"] / one["median_ms"])
    zp, zt = pairs[("zero3", "pynccl")], pairs[("zero3", "torch")]
    assert zp["cost_vs_torch"] == (zp["cost_over_floor_ms"] / zt["cost_over_floor_ms"]
                                   if zt["cost_over_floor_ms"] > 0 else None)
    assert "cost_vs_torch" not in zt and "PROBLEM" not in printed

    # The printed summary: the numbers of its floor lines from the table's (2 decimals, each within
    # 0.005 of its value; ratios 3 decimals): a difference of two within 0.01 (+0.005 its own
    # rounding), a quotient a/b within (0.005 + 0.005·|a/b|) / (|b| - 0.005) (+0.0005).
    summary = printed[printed.index("# summary"):]
    ms = _printed_medians(summary)
    def quotient_err(a, b):
        return (0.005 + 0.005 * abs(a / b)) / (abs(b) - 0.005) + 0.0005 + 1e-9
    m = re.search(r"# floor zero3 eager: floor pynccl ([\d.]+) ms, torch ([\d.]+) ms; cost over floor pynccl "
                  r"([+-][\d.]+) ms, torch ([+-][\d.]+) ms; pynccl cost / torch cost (\S+)", summary)
    assert m, summary
    floor_p, floor_t, cost_p, cost_t = map(float, m.groups()[:4])
    assert floor_p == ms[("zero3", "pynccl ZeRO-3", "eager", "1")]
    assert floor_t == ms[("zero3", "FSDP2 (titan wrap)", "eager", "1")]
    assert abs(cost_p - (ms[("zero3", "pynccl ZeRO-3", "eager", "dp2")] - floor_p)) <= 0.015 + 1e-9
    assert abs(cost_t - (ms[("zero3", "FSDP2 (titan wrap)", "eager", "dp2")] - floor_t)) <= 0.015 + 1e-9
    if zt["cost_over_floor_ms"] > 0.01:
        assert abs(float(m[5]) - cost_p / cost_t) <= quotient_err(cost_p, cost_t), (m[5], cost_p, cost_t)
    elif zt["cost_over_floor_ms"] <= 0:
        assert m[5] == "-"
    m = re.search(r"# floor tp eager: one GPU ([\d.]+) ms; scaling \(step / one-GPU step, target <= 0.6\): "
                  r"pynccl ([\d.]+) ms = ([\d.]+), torch ([\d.]+) ms = ([\d.]+)", summary)
    assert m, summary
    one, step_p, scale_p, step_t, scale_t = map(float, m.groups())
    assert one == ms[("tp", "plain model (1 GPU)", "eager", "1")]
    assert (step_p, step_t) == (ms[("tp", "pynccl TP", "eager", "tp2")], ms[("tp", "DTensor TP", "eager", "tp2")])
    assert abs(scale_p - step_p / one) <= quotient_err(step_p, one)
    assert abs(scale_t - step_t / one) <= quotient_err(step_t, one)


def test_floor_rows_pair_only_with_floors():
    """A floor trains one replica's batch: its loss is checked against the other side's floor (and its
    own eager floor), never against a pair row; a pair's ratios and costs take the pair's rows and
    its own side's floor (zero3) or the plain model both sides share (ddp)."""
    from train_bench_lib import report

    def row(strategy, impl, ms, loss, layout="dp2", floor=False):
        return dict(strategy=strategy, impl=impl, layout=layout, median_ms=ms, loss=loss, compiled=False,
                    **(dict(floor=True) if floor else {}))
    rows = [row("zero3", "pynccl", 30.0, 2.00), row("zero3", "torch", 40.0, 2.01),
            row("zero3", "pynccl", 20.0, 1.50, "1", True), row("zero3", "torch", 24.0, 1.60, "1", True),
            row("ddp", "pynccl", 12.0, 2.0), row("ddp", "torch", 11.0, 2.0), row("ddp", "plain", 10.0, 1.5, "1", True)]
    assert report.loss_problems(rows, 0.02) == [
        "zero3: pynccl floor eager loss 1.5000 vs torch floor eager 1.6000, more than 2% apart"]
    report.add_ratios(rows)
    zp, zt, dp, dt = rows[0], rows[1], rows[4], rows[5]
    assert (zp["ms_vs_torch"], zp["floor_ms"], zp["cost_over_floor_ms"]) == (0.75, 20.0, 10.0)
    assert zt["cost_over_floor_ms"] == 16.0
    assert zp["cost_vs_torch"] == 10.0 / 16.0 and "ms_vs_torch" not in rows[2]
    assert (dp["floor_ms"], dp["cost_over_floor_ms"], dt["cost_over_floor_ms"]) == (10.0, 2.0, 1.0)
    assert dp["cost_vs_torch"] == 2.0
    assert report.floor_lines(rows) == [
        "# floor zero3 eager: floor pynccl 20.00 ms, torch 24.00 ms; cost over floor pynccl +10.00 ms, "
        "torch +16.00 ms; pynccl cost / torch cost 0.625",
        "# floor ddp eager: floor (plain model) 10.00 ms; cost over floor pynccl +2.00 ms, torch +1.00 ms; "
        "pynccl cost / torch cost 2.000"]
    assert report.runs_as("ddp", "plain", "1") == report.ONE_GPU_TORCH


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


def test_kernel_profile_categories_and_exposed_comm():
    """--profile's arithmetic: an NCCL kernel 0.3 ms under a Triton kernel exposes only its other
    0.7 ms; two overlapping compute kernels count once in the busy time but fully in their
    categories; a peer-to-peer copy (a copy-engine collective) is communication, a local one is not."""
    from train_bench_lib.kernel_profile import category, summarize
    assert [category(n) for n in ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "nvjet_hsh_256x128_2x1_v_bz",
                                  "sm90_xmma_gemm_bf16bf16", "flash_fwd_kernel", "triton_poi_fused_add_0",
                                  "Memcpy DtoD (Device -> Device)", "Memcpy PtoP (Device -> Device)",
                                  "elementwise_kernel")] == \
        ["nccl", "gemm", "gemm", "attention", "triton", "memcpy/memset", "peer copies", "other"]
    kernels = [("nvjet_gemm", 0.0, 1000.0), ("triton_poi_fused", 500.0, 1500.0),
               ("ncclDevKernel_AllReduce", 1200.0, 2200.0)]
    s = summarize(kernels, steps=1, wall_ms=3.0)
    assert s["busy"] == pytest.approx(2.2) and s["compute_busy"] == pytest.approx(1.5)
    assert s["exposed_comm"] == pytest.approx(0.7)
    assert (s["gemm"], s["triton"], s["nccl"], s["other"]) == pytest.approx((1.0, 1.0, 1.0, 0.0))
    assert summarize(kernels, steps=2, wall_ms=3.0)["busy"] == pytest.approx(1.1)
    ce = summarize([("nvjet_gemm", 0.0, 1000.0), ("Memcpy PtoP (Device -> Device)", 800.0, 1800.0)], 1, 2.0)
    assert ce["exposed_comm"] == pytest.approx(0.8) and ce["peer copies"] == pytest.approx(1.0)
