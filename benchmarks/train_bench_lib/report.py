"""train_bench's output: one table row per (strategy, side, eager or compiled), and with --floor the
floor rows (floor.py: "floor": true, layout 1); the ratios of each pair, its costs over the floors
and TP's scaling, the loss checks, the rows as JSON, a bar plot of tokens/s per strategy (pynccl
next to torch)."""
from __future__ import annotations

import json
import math
from typing import List

# What each side runs, for the "runs" column (the "mode" column says how it was compiled).
PYNCCL_NAMES = {"ddp": "pynccl DDP", "zero1": "pynccl ZeRO-1", "zero2": "pynccl ZeRO-2", "zero3": "pynccl ZeRO-3",
                "tp": "pynccl TP", "tp-sp": "pynccl TP+SP", "tp-sp-async": "pynccl TP+SP", "pp-gpipe": "pynccl GPipe",
                "pp-1f1b": "pynccl 1F1B", "pp-interleaved": "pynccl interleaved 1F1B", "tp2xdp2": "pynccl TP + ZeRO-3",
                "pp-gpipe-graphs": "pynccl GPipe, graphs", "pp-1f1b-graphs": "pynccl 1F1B, graphs",
                "pp-interleaved-graphs": "pynccl interl. 1F1B, graphs"}
TORCH_NAMES = {"ddp": "torch DDP", "zero1": "DDP + ZeroRedundancyOpt", "zero2": "FSDP2 no reshard (titan)",
               "zero3": "FSDP2 (titan wrap)", "tp": "DTensor TP", "tp-sp": "DTensor TP+SP",
               "tp-sp-async": "DTensor TP+SP, async TP", "pp-gpipe": "pipelining GPipe",
               "pp-1f1b": "pipelining 1F1B", "pp-interleaved": "pipelining Interleaved1F1B",
               "tp2xdp2": "FSDP2 (titan) + DTensor TP", "pp-gpipe-graphs": "pipelining GPipe",
               "pp-1f1b-graphs": "pipelining 1F1B", "pp-interleaved-graphs": "pipelining Interleaved1F1B"}
ONE_GPU_TORCH = "plain model (1 GPU)"           # torch's side of tp at world size 1, --floor's "plain": no wrapper
IMPLS = ("pynccl", "torch")
TP_SCALING_TARGET = 0.6                         # issue 27: a tp 2 step <= 0.6 x the one-GPU step


def runs_as(strategy: str, impl: str, layout: str = "") -> str:
    if impl == "plain" or (impl == "torch" and strategy in ("tp", "tp-sp") and layout == "1"):
        return ONE_GPU_TORCH
    return (PYNCCL_NAMES if impl == "pynccl" else TORCH_NAMES)[strategy]


def _pair_key(r: dict):
    return r["strategy"], bool(r.get("compiled"))


def _mode(r: dict) -> str:
    return "compiled" if r.get("compiled") else "eager"


def _pair_rows(rows: List[dict]) -> List[dict]:
    """The rows of the pairs themselves (not --floor's), that ran."""
    return [r for r in rows if not r.get("floor") and not r.get("error")]


def add_ratios(rows: List[dict]) -> None:
    """On each pynccl row: its median step time over torch's for the same strategy and mode
    (eager / compiled; < 1: faster), and the same for the wall time per step. Then add_floor_ratios."""
    ref = {_pair_key(r): r for r in _pair_rows(rows) if r["impl"] == "torch"}
    for r in _pair_rows(rows):
        t = ref.get(_pair_key(r))
        if r["impl"] == "pynccl" and t:
            r["ms_vs_torch"] = r["median_ms"] / t["median_ms"]
            if r.get("wall_ms") and t.get("wall_ms"):
                r["wall_vs_torch"] = r["wall_ms"] / t["wall_ms"]
    add_floor_ratios(rows)


def _is_tp(strategy: str) -> bool:
    return strategy in ("tp", "tp-sp", "tp-sp-async")


def add_floor_ratios(rows: List[dict]) -> None:
    """With --floor rows: on each pair row, floor_ms (its side's floor: its own wrapper at world size
    1, or the plain model both sides share) and either scaling = median_ms / floor_ms (tp: the
    one-GPU step; target <= 0.6 at tp 2) or cost_over_floor_ms = median_ms - floor_ms; on the
    pynccl row, cost_vs_torch = its cost / torch's (None where torch's cost is not positive)."""
    floors = {_pair_key(r) + (r["impl"],): r for r in rows if r.get("floor") and not r.get("error")}
    pairs = _pair_rows(rows)
    for r in pairs:
        f = floors.get(_pair_key(r) + (r["impl"],)) or floors.get(_pair_key(r) + ("plain",))
        if f is None:
            continue
        r["floor_ms"], r["floor_impl"] = f["median_ms"], f["impl"]
        if _is_tp(r["strategy"]):
            r["scaling"] = r["median_ms"] / f["median_ms"]
        else:
            r["cost_over_floor_ms"] = r["median_ms"] - f["median_ms"]
    torch_cost = {_pair_key(r): r["cost_over_floor_ms"] for r in pairs
                  if r["impl"] == "torch" and "cost_over_floor_ms" in r}
    for r in pairs:
        t = torch_cost.get(_pair_key(r))
        if r["impl"] == "pynccl" and "cost_over_floor_ms" in r and t is not None:
            r["cost_vs_torch"] = r["cost_over_floor_ms"] / t if t > 0 else None


def floor_lines(rows: List[dict]) -> List[str]:
    """The summary's floor lines, one per pair with a floor, from the fields add_floor_ratios set."""
    by_pair = {}
    for r in _pair_rows(rows):
        if "floor_ms" in r:
            by_pair.setdefault(_pair_key(r), {})[r["impl"]] = r
    out = []
    for (strategy, _), sides in by_pair.items():
        p, t = sides.get("pynccl"), sides.get("torch")
        head = f"# floor {strategy} {_mode(p or t)}:"
        if _is_tp(strategy):
            one = (p or t)["floor_ms"]
            parts = [f"{name} {r['median_ms']:.2f} ms = {r['scaling']:.3f}" for name, r in (("pynccl", p), ("torch", t))
                     if r is not None]
            out.append(f"{head} one GPU {one:.2f} ms; scaling (step / one-GPU step, target <= "
                       f"{TP_SCALING_TARGET}): " + ", ".join(parts))
            continue
        if (p or t)["floor_impl"] == "plain":       # one floor for both sides
            floors = f"(plain model) {(p or t)['floor_ms']:.2f} ms"
        else:
            floors = ", ".join(f"{name} {r['floor_ms']:.2f} ms" for name, r in (("pynccl", p), ("torch", t)) if r)
        costs = ", ".join(f"{name} {r['cost_over_floor_ms']:+.2f} ms" for name, r in (("pynccl", p), ("torch", t)) if r)
        ratio = "" if p is None or "cost_vs_torch" not in p else (
            f"; pynccl cost / torch cost {_opt(p['cost_vs_torch'], '.3f', 0).strip()}")
        out.append(f"{head} floor {floors}; cost over floor {costs}{ratio}")
    return out


def loss_problems(rows: List[dict], rtol: float, prefix: str = "") -> List[str]:
    """Pairs that did not train alike: the final losses of pynccl and torch in one mode, and of
    the compiled and the eager run of one side, more than rtol apart (relative); the floors alike
    among themselves (a floor trains one replica's batch: it is not compared with its pair). bf16
    noise after a dozen steps is well under 1 %; a side that trains differently is far over."""
    final = {(r["strategy"], r["impl"], bool(r.get("compiled")), bool(r.get("floor"))): r["loss"]
             for r in rows if not r.get("error")}
    problems = []
    for (strategy, impl, compiled, floor), loss in final.items():
        mode = ("floor " if floor else "") + ("compiled" if compiled else "eager")
        refs = []
        if impl == "pynccl":
            refs.append(((strategy, "torch", compiled, floor), f"torch {mode}"))
        if compiled:
            refs.append(((strategy, impl, False, floor), f"{impl} {'floor ' if floor else ''}eager"))
        for key, what in refs:
            ref = final.get(key)
            if ref is not None and abs(loss - ref) > rtol * abs(ref):
                problems.append(f"{prefix}{strategy}: {impl} {mode} loss {loss:.4f} vs {what} {ref:.4f}, "
                                f"more than {rtol:.0%} apart")
    return problems


def tp_scaling(rows: List[dict]) -> List[str]:
    """TP's scaling against its one-GPU reference (rows of several runs, each with "run" and
    "model_shape"): a tp / tp-sp row's median step over the one-GPU plain model's (tp at world size
    1, torch's side) of the same model and per-rank batch, in the same mode; issue 27's target is
    <= 0.6 at tp 2 (a scaling efficiency of >= 83 %). A row that has its scaling from a --floor of
    its own run (floor_lines reports it) is left out here, so no pair is reported twice."""
    ref = {(r["model_shape"], bool(r.get("compiled"))): r for r in rows
           if r["strategy"].startswith("tp") and r["impl"] in ("torch", "plain") and r["layout"] == "1"
           and not r.get("error")}
    out = []
    for r in rows:
        one = ref.get((r["model_shape"], bool(r.get("compiled"))))
        if one is None or r.get("error") or not r["strategy"].startswith("tp") or not r["layout"].startswith("tp") \
                or r.get("scaling") is not None:
            continue
        tp = int(r["layout"][2:])
        ratio = r["median_ms"] / one["median_ms"]
        out.append(f"TP scaling: {r['run']} {r['strategy']} {runs_as(r['strategy'], r['impl'], r['layout'])} "
                   f"({r.get('recipe', 'eager')}) at tp {tp}: {r['median_ms']:.2f} ms = {ratio:.3f} x the one-GPU "
                   f"{one['median_ms']:.2f} ms ({one['run']}); efficiency {1 / (tp * ratio):.0%}")
    return out


HEADER = (f"{'strategy':<13}{'runs':<27}{'mode':<26}{'layout':<8}{'tokens/s':>10}{'tok/s/GPU':>10}{'MFU':>7}"
          f"{'median ms':>10}{'min ms':>9}{'peak GiB':>9}{'loss':>8}{'ms vs torch':>12}{'wall ms':>9}"
          f"{'wall vs torch':>14}{'breaks':>7}")


def _opt(value, fmt: str, width: int) -> str:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return f"{'-' if missing else format(value, fmt):>{width}}"


def format_row(r: dict) -> str:
    head = (f"{r['strategy']:<13}{runs_as(r['strategy'], r['impl'], r.get('layout', '')):<27}"
            f"{r.get('recipe', 'eager'):<26}{r['layout']:<8}")
    if r.get("error"):
        return head + f"FAILED: {r['error']}"
    mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    return head + (f"{r['tokens_per_s']:>10,.0f}{_opt(r.get('tokens_per_s_gpu'), ',.0f', 10)}{mfu:>7}"
                   f"{r['median_ms']:>10.2f}{r['min_ms']:>9.2f}{_opt(r['peak_gib'], '.2f', 9)}{r['loss']:>8.4f}"
                   f"{_opt(r.get('ms_vs_torch'), '.3f', 12)}{_opt(r.get('wall_ms') or None, '.2f', 9)}"
                   f"{_opt(r.get('wall_vs_torch'), '.3f', 14)}{_opt(r.get('graph_breaks'), 'd', 7)}")


def window_notes(rows: List[dict]) -> List[str]:
    """One line per row whose peak includes NCCL symmetric windows (outside torch's allocator)."""
    return [f"# peak of {r['strategy']} {runs_as(r['strategy'], r['impl'], r.get('layout', ''))} "
            f"({r.get('recipe', 'eager')}): {r['peak_gib']:.2f} GiB = {r['peak_allocated_gib']:.2f} "
            f"max_memory_allocated + {r['window_gib']:.2f} in NCCL symmetric windows (ncclMemAlloc)"
            for r in rows if not r.get("error") and r.get("window_gib")]


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
    def label(r):
        return r["strategy"] + (" (compiled)" if r.get("compiled") else "")
    strategies = list(dict.fromkeys(label(r) for r in rows))
    value = {(label(r), r["impl"]): r.get("tokens_per_s", 0.0) for r in _pair_rows(rows)}
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
