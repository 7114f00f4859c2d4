"""Everything rank 0 writes: the nccl-tests header, rows and footer, the pynccl-vs-torch table,
and the JSON file (nccl-tests' JSON v2 layout, with pynccl's extras under "pynccl")."""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics
import sys
from typing import List, Optional

from . import formatting as fmt
from .harness import PLACEMENTS, Row

# Environment variables worth recording with a result (nccl-tests dumps the whole environment;
# we keep to those that change how collectives run, so no credentials end up in a results file).
_ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYNCCL_", "OMP_", "MASTER_", "WORLD_SIZE", "LOCAL_")


def now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def nccl_env() -> List[str]:
    """NCCL_* settings in effect: the environment, then NCCL's config files (which NCCL also reads)."""
    lines = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")]
    for path in (os.environ.get("NCCL_CONF_FILE"), os.path.expanduser("~/.nccl.conf"), "/etc/nccl.conf"):
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    for line in f:
                        line = line.strip()
                        if line and not line.startswith("#") and "=" in line:
                            lines.append(f"{line} (from {path})")
            except OSError:
                pass
    return lines


def nccl_codes():
    """(nccl-headers, nccl-library) codes from pynccl.nccl_version(); 0 where unknown."""
    import pynccl
    from pynccl import _ext
    c_ext = getattr(_ext, "_C", None)
    if c_ext is not None and hasattr(c_ext, "nccl_version_build") and hasattr(c_ext, "nccl_version_runtime"):
        return int(c_ext.nccl_version_build()), int(c_ext.nccl_version_runtime())
    try:
        v = pynccl.nccl_version()
    except Exception:  # noqa: BLE001 - no extension: nothing to report
        v = None
    if isinstance(v, dict):
        headers = next((v[k] for k in ("headers", "compile", "build", "compiled") if k in v), None)
        library = next((v[k] for k in ("library", "runtime", "loaded") if k in v), None)
        return fmt.nccl_version_code(headers), fmt.nccl_version_code(library)
    for h, lib in (("headers", "library"), ("compile", "runtime"), ("build", "runtime")):
        if hasattr(v, h) and hasattr(v, lib):
            return fmt.nccl_version_code(getattr(v, h)), fmt.nccl_version_code(getattr(v, lib))
    if isinstance(v, (tuple, list)) and len(v) == 2 and not all(isinstance(x, int) and x < 100 for x in v):
        return fmt.nccl_version_code(v[0]), fmt.nccl_version_code(v[1])
    code = fmt.nccl_version_code(v)
    return code, code


class Reporter:
    """Prints on rank 0 only; collects rows for the comparison table, the JSON file and the plot."""

    def __init__(self, op, ctx, device_lines: List[str], backend: str, out=None):
        self.op, self.ctx, self.opts = op, ctx, ctx.opts
        self.device_lines = device_lines
        self.backend = backend
        self.is_main = ctx.rank == 0
        self.out = out or sys.stdout
        self.rows: List[Row] = []
        self.notes: List[str] = []
        self.start_time = now()
        self.primary = ctx.impls[0]

    def _print(self, line: str = "") -> None:
        if self.is_main:
            print(line, file=self.out, flush=True)

    # -------------------------------------------------------------- nccl-tests text
    def header(self) -> None:
        import pynccl
        o = self.opts
        headers, library = nccl_codes()
        if o.json:
            self._print(f"# Writing JSON output to {self.json_path}")
        self._print(f"# pynccl-bench version {pynccl.__version__} nccl-headers={headers} nccl-library={library}")
        self._print(f"# Collective test starting: {self.op.perf_name}")
        step = f"{o.stepfactor}(factor)" if o.stepfactor > 1 else f"{o.stepbytes}(bytes)"
        self._print(f"# nThread 1 nGpus 1 minBytes {o.minbytes} maxBytes {o.maxbytes} step: {step} "
                    f"warmup iters: {o.warmup_iters} iters: {o.iters} agg iters: 1 validation: {o.check} "
                    f"graph: {o.cudagraph}")
        if o.blocking == 1:
            self._print("# Blocking Enabled: wait for completion and barrier after each collective")
        elif o.blocking > 1:
            self._print("# Blocking Enabled: wait for completion after each collective (no barrier)")
        impls = ", ".join(i.label for i in self.ctx.impls)
        self._print(f"# Backend {self.backend}, world size {self.ctx.nranks}, implementation: {impls}"
                    + (f", median of {o.reps} repetitions" if o.reps > 1 else ""))
        if o.report_cputime:
            self._print("# Host overhead mode (-C): the time column is host time to enqueue one op; "
                        "bandwidths use wall time")
        env = nccl_env()
        self._print("# NCCL environment: " + (" ".join(env) if env else "(no NCCL_* variables set)"))
        self._print("#")
        self._print("# Using devices")
        for line in self.device_lines:
            self._print(line)
        self._print("#")
        for line in fmt.table_header(bool(o.report_cputime)):
            self._print(line)

    def note(self, message: str, once: bool = False) -> None:
        if once and message in self.notes:
            return
        self.notes.append(message)
        self._print(f"# {message}")

    def _shown_time(self, cell) -> Optional[float]:
        t = cell.cpu_s if self.opts.report_cputime else cell.time_s
        return None if t is None else t * 1e6

    def row_text(self, row: Row, impl_name: str) -> str:
        text = fmt.row_prefix(row.size, row.count, row.type_name, row.redop, row.root)
        for in_place in PLACEMENTS:
            cell = row.cells[(impl_name, in_place)]
            text += fmt.cell_text(self._shown_time(cell), cell.algbw, cell.busbw, cell.wrong)
        return text

    def row(self, row: Row) -> None:
        self.rows.append(row)
        self._print(self.row_text(row, self.primary.name))
        for in_place in PLACEMENTS:
            cell = row.cells[(self.primary.name, in_place)]
            if cell.error:
                self._print(f"# {'in-place' if in_place else 'out-of-place'} did not run: {cell.error}")

    def summary(self, impl_name: str):
        """(failed checks, avg busbw over every printed cell) of one implementation."""
        cells = [r.cells[(impl_name, p)] for r in self.rows for p in PLACEMENTS]
        failed = sum(1 for c in cells if c.wrong)
        bws = [c.busbw for c in cells if c.busbw is not None]
        return failed, (sum(bws) / len(bws) if bws else 0.0)

    def finish(self) -> int:
        """Footer, comparison, JSON; returns the number of failed checks over all implementations."""
        failed, avg = self.summary(self.primary.name)
        for line in fmt.footer(failed, avg, self.op.perf_name)[:2]:
            self._print(line)
        total_failed = failed
        if len(self.ctx.impls) > 1:
            total_failed += self._comparison()
        if self.is_main and self.opts.plot:
            from .plot import render
            path = self.opts.plot.replace("{op}", self.op.name)
            render(path, self)
            self._print(f"# Wrote plot to {path}")
        self._print("#")
        self._print(f"# Collective test concluded: {self.op.perf_name}")
        if self.is_main and self.opts.json:
            self._write_json(self.json_path)
        return total_failed

    @property
    def json_path(self) -> str:
        return self.opts.json.replace("{op}", self.op.name)

    # -------------------------------------------------------------- pynccl vs torch
    def _comparison(self) -> int:
        a, b = self.ctx.impls[0], self.ctx.impls[1]
        unit = "host time to enqueue one op" if self.opts.report_cputime else "time per op"
        self._print("#")
        self._print(f"# {a.name} vs {b.name} ({b.label}), same processes and buffers: {unit} (us) and busbw "
                    f"(GB/s) of each; ratio = {a.name} time / {b.name} time (< 1: {a.name} faster)")
        if self.op.name in ("all_reduce", "reduce", "broadcast"):
            self._print(f"# out-of-place: {a.name} passes output= (one NCCL call on nccl); {b.name} is copy_ + the "
                        f"in-place op (its API has no output)")
        # The prefix "# %10s  %8s  %6s  %6s" is 38 wide and each placement block 44.
        self._print(("#" + " " * 37 + "out-of-place".center(44) + "in-place".center(44)).rstrip())
        cols = "  %8s  %8s  %6s  %6s  %6s"
        self._print("# %10s  %8s  %6s  %6s" % ("size", "type", "redop", "root")
                    + (cols % (a.name, b.name, a.name, b.name, "ratio")) * 2)
        self._print("# %10s  %8s  %6s  %6s" % ("(B)", "", "", "")
                    + ((cols % ("(us)", "(us)", "(GB/s)", "(GB/s)", "")) * 2).rstrip())
        ratios = []
        for row in self.rows:
            text = "#%11li  %8s  %6s  %6s" % (row.size, row.type_name, row.redop, "%6i" % row.root)
            for in_place in PLACEMENTS:
                ca, cb = row.cells[(a.name, in_place)], row.cells[(b.name, in_place)]
                ta, tb = self._shown_time(ca), self._shown_time(cb)
                ratio = ta / tb if ta is not None and tb else None
                if ratio is not None:
                    ratios.append((ratio, row.size, in_place))
                text += cols % (fmt.float_str(ta, 8), fmt.float_str(tb, 8), fmt.float_str(ca.busbw, 6),
                                fmt.float_str(cb.busbw, 6), fmt.float_str(ratio, 6))
            self._print(text)
        failed_b, avg_b = self.summary(b.name)
        self._print("# %s: %-20s : %d %s" % (b.name, "Out of bounds values", failed_b, "FAILED" if failed_b else "OK"))
        self._print("# %s: %-20s : %g" % (b.name, "Avg bus bandwidth", avg_b))
        if b.name in self.ctx.disabled:
            self._print(f"# {b.name} stopped early: {self.ctx.disabled[b.name]}")
        if ratios:
            worst = max(ratios)
            gmean = math.exp(sum(math.log(r) for r, _, _ in ratios) / len(ratios))
            self._print(f"# ratio {a.name}/{b.name}: geometric mean {gmean:.3f}, max {worst[0]:.3f} at {worst[1]} B "
                        f"{'in-place' if worst[2] else 'out-of-place'}")
        if self.opts.reps > 1:
            for impl in (a, b):
                spreads = [(max(c.rep_times) - min(c.rep_times)) / statistics.median(c.rep_times)
                           for r in self.rows for p in PLACEMENTS
                           for c in [r.cells[(impl.name, p)]] if len(c.rep_times) > 1]
                if spreads:
                    self._print(f"# spread over {self.opts.reps} repetitions ({impl.name}, rank 0, (max-min)/median): "
                                f"median {statistics.median(spreads) * 100:.1f}%, max {max(spreads) * 100:.1f}%")
        return failed_b

    # -------------------------------------------------------------- JSON
    def _cell_json(self, cell, impl_name=None) -> dict:
        key = "cpu_time" if self.opts.report_cputime else "time"
        return {key: self._shown_time(cell), "alg_bw": cell.algbw, "bus_bw": cell.busbw,
                "nwrong": None if cell.wrong is None else float(cell.wrong)}

    def _rows_json(self, impl_name: str) -> list:
        out = []
        for r in self.rows:
            item = {"size": r.size, "count": r.count, "type": r.type_name, "redop": r.redop, "root": "%6i" % r.root}
            item["out_of_place"] = self._cell_json(r.cells[(impl_name, False)])
            item["in_place"] = self._cell_json(r.cells[(impl_name, True)])
            item["actual_iterations"] = self.opts.iters
            item["experiment_name"] = ""
            out.append(item)
        return out

    def _write_json(self, path: str) -> None:
        o = self.opts
        failed, avg = self.summary(self.primary.name)
        _, library = nccl_codes()
        config = {"nthreads": 1, "ngpus": 1, "minimum_bytes": o.minbytes, "maximum_bytes": o.maxbytes}
        if o.stepfactor > 1:
            config["step_factor"] = o.stepfactor
        else:
            config["step_bytes"] = o.stepbytes
        config.update({"warmup_iters": o.warmup_iters, "iterations": o.iters, "aggregated_iterations": 1,
                       "validation": o.check, "graph": o.cudagraph,
                       # NOTE: nccl-tests writes its booleans as the strings "true"/"false".
                       "blocking_collectives": "true" if o.blocking else "false",
                       "per_iter_timing": "false", "parallel_init": "false",
                       "devices": [_parse_device_line(line) for line in self.device_lines]})
        impls = {}
        for impl in self.ctx.impls:
            f_i, avg_i = self.summary(impl.name)
            impls[impl.name] = {
                "label": impl.label, "results": self._rows_json(impl.name),
                "rep_times_us_rank0": [[[t * 1e6 for t in r.cells[(impl.name, p)].rep_times] for p in PLACEMENTS]
                                       for r in self.rows],
                "out_of_bounds": {"count": f_i, "okay": f_i == 0},
                "average_bus_bandwidth": avg_i, "stopped": self.ctx.disabled.get(impl.name)}
        doc = {
            "version": 2, "start_time": self.start_time, "args": list(sys.argv),
            "env": [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)],
            "nccl_version": library, "config": config, "results": self._rows_json(self.primary.name),
            "out_of_bounds": {"count": failed, "okay": "true" if failed == 0 else "false"},
            "average_bus_bandwidth": {"bandwidth": avg, "okay": "unchecked"},
            "errors": [], "end_time": now(),
            "pynccl": {"op": self.op.name, "backend": self.backend, "world_size": self.ctx.nranks,
                       "impls": [i.name for i in self.ctx.impls], "reps": o.reps, "average": o.average,
                       "report_cputime": bool(o.report_cputime), "nccl_env": nccl_env(),
                       "notes": self.notes, "implementations": impls, "comparison": self._comparison_json()},
        }
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    def _comparison_json(self) -> list:
        if len(self.ctx.impls) < 2:
            return []
        a, b = self.ctx.impls[0].name, self.ctx.impls[1].name
        out = []
        for r in self.rows:
            for p in PLACEMENTS:
                ca, cb = r.cells[(a, p)], r.cells[(b, p)]
                ta, tb = self._shown_time(ca), self._shown_time(cb)
                out.append({"size": r.size, "count": r.count, "type": r.type_name, "redop": r.redop, "root": r.root,
                            "placement": "in_place" if p else "out_of_place",
                            f"{a}_time_us": ta, f"{b}_time_us": tb, f"{a}_bus_bw": ca.busbw, f"{b}_bus_bw": cb.busbw,
                            "ratio": ta / tb if ta is not None and tb else None})
        return out


def _parse_device_line(line: str) -> dict:
    # "#  Rank  0 Group  0 Pid  12345 on   hostname device  0 [0000:18:00] NVIDIA H200"
    m = re.match(r"#\s+Rank\s+(-?\d+)\s+Group\s+(-?\d+)\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(-?\d+)\s+\[([^\]]*)\]\s*(.*)",
                 line)
    if not m:
        return {"line": line}
    return {"rank": int(m[1]), "group": int(m[2]), "pid": int(m[3]), "hostname": m[4], "device": int(m[5]),
            "device_hex": m[6], "device_info": m[7]}
