"""train_bench's output: one table row per (strategy, side), the rows as JSON, a bar plot of
tokens/s per strategy (pynccl next to torch)."""
from __future__ import annotations

import json
import math
from typing import List

# What each side runs, for the "runs" column.
PYNCCL_NAMES = {"ddp": "pynccl DDP", "zero1": "pynccl ZeRO-1", "zero2": "pynccl ZeRO-2", "zero3": "pynccl ZeRO-3",
                "tp": "pynccl TP", "tp-sp": "pynccl TP+SP", "pp-gpipe": "pynccl GPipe", "pp-1f1b": "pynccl 1F1B",
                "pp-interleaved": "pynccl interleaved 1F1B", "tp2xdp2": "pynccl TP + ZeRO-3",
                "pp-gpipe-graphs": "pynccl GPipe, graphs", "pp-1f1b-graphs": "pynccl 1F1B, graphs",
                "pp-interleaved-graphs": "pynccl interl. 1F1B, graphs"}
TORCH_NAMES = {"ddp": "torch DDP", "zero1": "torch FSDP2", "zero2": "torch FSDP2", "zero3": "torch FSDP2",
               "tp": "DTensor TP", "tp-sp": "DTensor TP+SP", "pp-gpipe": "pipelining GPipe",
               "pp-1f1b": "pipelining 1F1B", "pp-interleaved": "pipelining Interleaved1F1B",
               "tp2xdp2": "FSDP2 + DTensor TP", "pp-gpipe-graphs": "pipelining GPipe",
               "pp-1f1b-graphs": "pipelining 1F1B", "pp-interleaved-graphs": "pipelining Interleaved1F1B"}
IMPLS = ("pynccl", "torch")


def runs_as(strategy: str, impl: str) -> str:
    return (PYNCCL_NAMES if impl == "pynccl" else TORCH_NAMES)[strategy]


def add_ratios(rows: List[dict]) -> None:
    """On each pynccl row: its median step time over torch's for the same strategy (< 1: faster),
    and the same for the wall time per step."""
    ref = {r["strategy"]: r for r in rows if r["impl"] == "torch" and not r.get("error")}
    for r in rows:
        t = ref.get(r["strategy"])
        if r["impl"] == "pynccl" and t and not r.get("error"):
            r["ms_vs_torch"] = r["median_ms"] / t["median_ms"]
            if r.get("wall_ms") and t.get("wall_ms"):
                r["wall_vs_torch"] = r["wall_ms"] / t["wall_ms"]


HEADER = (f"{'strategy':<22}{'runs':<29}{'layout':<11}{'tokens/s':>11}{'median ms':>11}{'min ms':>9}"
          f"{'peak GiB':>10}{'loss':>9}{'ms vs torch':>13}{'wall ms':>9}{'wall vs torch':>15}")


def format_row(r: dict) -> str:
    head = f"{r['strategy']:<22}{runs_as(r['strategy'], r['impl']):<29}{r['layout']:<11}"
    if r.get("error"):
        return head + f"FAILED: {r['error']}"
    peak = "-" if math.isnan(r["peak_gib"]) else f"{r['peak_gib']:.2f}"
    ratio = f"{r['ms_vs_torch']:.3f}" if "ms_vs_torch" in r else "-"
    wall = f"{r['wall_ms']:.2f}" if r.get("wall_ms") else "-"
    wall_ratio = f"{r['wall_vs_torch']:.3f}" if "wall_vs_torch" in r else "-"
    return head + (f"{r['tokens_per_s']:>11,.0f}{r['median_ms']:>11.2f}{r['min_ms']:>9.2f}{peak:>10}"
                   f"{r['loss']:>9.4f}{ratio:>13}{wall:>9}{wall_ratio:>15}")


def print_table(rows: List[dict]) -> None:
    print(HEADER)
    for r in rows:
        print(format_row(r))


def write_json(path: str, header: dict, rows: List[dict]) -> None:
    def clean(v):
        return None if isinstance(v, float) and math.isnan(v) else v
    with open(path, "w") as f:
        json.dump(dict(header, rows=[{k: clean(v) for k, v in r.items()} for r in rows]), f, indent=1)


def plot(path: str, title: str, rows: List[dict]) -> None:
    """Grouped bars: tokens/s of pynccl and torch for each strategy (failed runs left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    value = {(r["strategy"], r["impl"]): r.get("tokens_per_s", 0.0) for r in rows if not r.get("error")}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(strategies) + 2), 4.2))
    width = 0.38
    for i, impl in enumerate(IMPLS):
        xs = [k + (i - 0.5) * width for k in range(len(strategies))]
        ys = [value.get((s, impl), 0.0) for s in strategies]
        bars = ax.bar(xs, ys, width, label=impl)
        for b, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:,.0f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(strategies)), strategies, rotation=20)
    ax.set_ylabel("tokens / s (whole job)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
