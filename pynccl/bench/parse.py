"""A parser for nccl-tests logs (NVIDIA's, and ours, which prints the same): header fields,
devices, one record per result row, the footer. Tolerant of what real logs interleave (NCCL INFO
lines, MPI noise, an extra timestamp column) and of several tests in one file.

    tests = parse_log(open("all_reduce.log").read())
    tests[0].rows[0].out_of_place.busbw
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


@dataclass
class Result:
    time_us: Optional[float]
    algbw: Optional[float]
    busbw: Optional[float]
    wrong: Optional[int]          # None where the log says N/A


@dataclass
class LogRow:
    size: int
    count: int
    type: str
    redop: str
    root: int
    out_of_place: Result
    in_place: Result


@dataclass
class LogTest:
    name: str = ""                                   # "all_reduce_perf"
    version_line: str = ""
    nccl_headers: Optional[int] = None
    nccl_library: Optional[int] = None
    params: dict = field(default_factory=dict)       # nThread, nGpus, minBytes, ... as ints
    devices: List[dict] = field(default_factory=list)
    time_label: str = "time"                         # "cputime" with -C
    rows: List[LogRow] = field(default_factory=list)
    out_of_bounds: Optional[int] = None
    avg_busbw: Optional[float] = None
    concluded: bool = False


def _num(text: str) -> Optional[float]:
    return None if text == "N/A" else float(text)


def _wrong(text: str) -> Optional[int]:
    return None if text == "N/A" else int(float(text))


_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)"
                  + rf"(?:\s+({_NUM}|N/A)\s+({_NUM}|N/A)\s+({_NUM}|N/A)\s+({_NUM}|N/A))" * 2)
_DEVICE = re.compile(r"^#\s+Rank\s+(-?\d+)\s+Group\s+(-?\d+)\s+Pid\s+(\d+)\s+on\s+(\S+)\s+device\s+(-?\d+)"
                     r"\s+\[([^\]]*)\]\s*(.*)$")
_PARAMS = re.compile(r"(nThread|nGpus|minBytes|maxBytes|warmup iters|agg iters|iters|validation|graph|unalign)"
                     r":?\s+(-?\d+)")


def parse_log(text: str) -> List[LogTest]:
    """Every test in the log, in order (a log written by one nccl-tests binary holds one)."""
    tests: List[LogTest] = []
    cur: Optional[LogTest] = None

    def begin(field_set: bool) -> LogTest:
        # The version line, "Collective test starting" and "# nThread" open a test (older
        # nccl-tests print only the last): a new one unless the current test is still in its header.
        nonlocal cur
        if cur is None or cur.rows or cur.concluded or field_set:
            cur = LogTest()
            tests.append(cur)
        return cur

    for line in text.splitlines():
        line = line.rstrip()
        if "nccl-headers=" in line and line.startswith("#"):
            t = begin(bool(cur and (cur.version_line or cur.name or cur.params)))
            t.version_line = line.lstrip("# ")
            m = re.search(r"nccl-headers=(\d+)\s+nccl-library=(\d+)", line)
            if m:
                t.nccl_headers, t.nccl_library = int(m[1]), int(m[2])
            continue
        if line.startswith("# Collective test starting:"):
            begin(bool(cur and (cur.name or cur.params))).name = line.split(":", 1)[1].strip()
            continue
        if line.startswith("# Collective test concluded:"):
            if cur is not None:
                cur.concluded = True
            continue
        if line.startswith("# nThread"):
            begin(bool(cur and cur.params))
        if cur is None:
            if not _ROW.match(line):
                continue
            begin(False)  # a log cut before its header: still read the rows
        if line.startswith("# nThread"):
            for key, value in _PARAMS.findall(line):
                cur.params[key] = int(value)
            m = re.search(r"step:\s+(\d+)\((factor|bytes)\)", line)
            if m:
                cur.params["step"] = int(m[1])
                cur.params["step_kind"] = m[2]
        elif _DEVICE.match(line):
            m = _DEVICE.match(line)
            cur.devices.append({"rank": int(m[1]), "group": int(m[2]), "pid": int(m[3]), "hostname": m[4],
                                "device": int(m[5]), "device_hex": m[6], "device_info": m[7]})
        elif re.match(r"^#\s+size\s+count\s+type", line):
            cur.time_label = "cputime" if "cputime" in line else "time"
        elif line.startswith("# Out of bounds values"):
            cur.out_of_bounds = int(line.split(":", 1)[1].split()[0])
        elif line.startswith("# Avg bus bandwidth"):
            cur.avg_busbw = float(line.split(":", 1)[1].split()[0])
        elif not line.startswith("#"):
            m = _ROW.match(line)
            if m:
                g = m.groups()
                cur.rows.append(LogRow(
                    size=int(g[0]), count=int(g[1]), type=g[2], redop=g[3], root=int(g[4]),
                    out_of_place=Result(_num(g[5]), _num(g[6]), _num(g[7]), _wrong(g[8])),
                    in_place=Result(_num(g[9]), _num(g[10]), _num(g[11]), _wrong(g[12]))))
    return tests
