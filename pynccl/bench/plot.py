"""--plot: bus bandwidth and time per op against message size, one line per implementation and
placement. matplotlib is imported only here, only when asked for.

At world size 1 busbw is 0 for the ops whose factor is (n-1)/n, so the left panel shows algbw
there instead (and says so); the right panel, time per op, is what matters at small sizes.
"""
from __future__ import annotations

import os

from .formatting import human_size
from .harness import PLACEMENTS


def require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("pynccl.bench: error: --plot needs matplotlib, which is not installed in this "
                         "Python environment: pip install matplotlib (or drop --plot)") from None


_COLORS = {"pynccl": "#1f77b4", "torch": "#d62728"}
_STYLE = {False: dict(linestyle="-", marker="o"), True: dict(linestyle="--", marker="s", markerfacecolor="none")}


def render(path: str, reporter) -> None:
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    op, ctx, opts = reporter.op, reporter.ctx, reporter.opts
    rows = [r for r in reporter.rows if r.size > 0]   # a log axis has no place for 0 B
    combos = sorted({(r.type_name, r.redop, r.root) for r in rows})
    use_algbw = op.bus_factor(ctx.nranks) == 0
    host_time = bool(opts.report_cputime)

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=110)
    for impl in ctx.impls:
        for combo in combos:
            series = [r for r in rows if (r.type_name, r.redop, r.root) == combo]
            for in_place in PLACEMENTS:
                cells = [(r.size, r.cells[(impl.name, in_place)]) for r in series]
                cells = [(s, c) for s, c in cells if c.time_s is not None]
                if not cells:
                    continue
                label = f"{impl.name} {'in-place' if in_place else 'out-of-place'}"
                if len(combos) > 1:
                    label += " " + " ".join(str(x) for x in combo if x not in ("none", -1))
                sizes = [s for s, _ in cells]
                bw = [(c.algbw if use_algbw else c.busbw) for _, c in cells]
                t = [(c.cpu_s if host_time else c.time_s) * 1e6 for _, c in cells]
                style = dict(color=_COLORS.get(impl.name), markersize=4, linewidth=1.6, **_STYLE[in_place])
                ax_bw.plot(sizes, bw, label=label, **style)
                ax_t.plot(sizes, t, label=label, **style)

    sizes = sorted({r.size for r in rows})
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        if sizes:
            ticks = _ticks(sizes)
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([human_size(s) for s in ticks], rotation=45, ha="right")
        ax.set_xlabel("message size (bytes, the nccl-tests size column)")
        ax.grid(True, which="major", alpha=0.35)
        ax.legend(fontsize=8, loc="best")
    ax_bw.set_ylabel("algbw (GB/s) — busbw is 0 at world size 1" if use_algbw else "busbw (GB/s)")
    ax_bw.set_ylim(bottom=0)
    ax_bw.set_title("algorithm bandwidth" if use_algbw else "bus bandwidth")
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_t.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))
    ax_t.set_ylabel("host time to enqueue one op (µs)" if host_time else "time per op (µs)")
    ax_t.set_title("host enqueue time per op (-C)" if host_time else "time per op (lower is better)")

    device = reporter.device_lines[0].split("]")[-1].strip() if reporter.device_lines else str(ctx.device)
    mode = f"CUDA graph ×{opts.cudagraph}" if opts.cudagraph else "eager"
    fig.suptitle(f"{op.perf_name} — {ctx.nranks} rank(s) × {device}, backend {reporter.backend}, {mode}, "
                 f"n={opts.iters}" + (f", median of {opts.reps}" if opts.reps > 1 else ""), fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _ticks(sizes):
    """At most ~12 power-of-two ticks spanning the sweep."""
    if len(sizes) <= 12:
        return sizes
    stride = -(-len(sizes) // 12)
    return sizes[::-1][::stride][::-1]  # counted from the largest size, so that it is labelled
