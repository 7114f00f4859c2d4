"""Bandwidth formulas and the exact text of an nccl-tests table, kept free of any process or
device so that tests can check them against hand-computed values."""
from __future__ import annotations

from typing import Optional

GB = 1e9  # nccl-tests' GB/s are 1e9 bytes per second


def float_str(value: Optional[float], width: int) -> str:
    """The first of %.2f, %.1f, %.0f that fits `width`, else %.1e; right-aligned (nccl-tests' getFloatStr).
    None (nothing measured) prints N/A."""
    if value is None:
        return "N/A".rjust(width)
    for fmt in ("%.2f", "%.1f", "%.0f"):
        text = fmt % value
        if len(text) <= width:
            return text.rjust(width)
    return ("%.1e" % value).rjust(width)


def bandwidths(size_bytes: int, seconds: float, bus_factor: float):
    """(algbw, busbw) in GB/s for `size_bytes` moved in `seconds`; busbw = algbw × the op's factor."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = size_bytes / GB / seconds
    return algbw, algbw * bus_factor


def wrong_str(wrong: Optional[int]) -> str:
    return "%6g" % wrong if wrong is not None else "   N/A"


def row_prefix(size: int, count: int, type_name: str, redop: str, root: int) -> str:
    # NOTE: root goes through "%6i" then "%6s", as nccl-tests prints it.
    return "%12li  %12li  %8s  %6s  %6s" % (size, count, type_name, redop, "%6i" % root)


def cell_text(time_us: Optional[float], algbw: Optional[float], busbw: Optional[float],
              wrong: Optional[int]) -> str:
    return "  %7s  %6s  %6s  %6s" % (float_str(time_us, 7), float_str(algbw, 6), float_str(busbw, 6),
                                     wrong_str(wrong))


def table_header(cputime: bool) -> list:
    """The three header lines of the result table (trailing blanks stripped)."""
    t = "cputime" if cputime else "time"
    lines = [
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place" % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s" % (
            "size", "count", "type", "redop", "root", t, "algbw", "busbw", "#wrong", t, "algbw", "busbw", "#wrong"),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s" % (
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""),
    ]
    return [line.rstrip() for line in lines]


def footer(num_failed_checks: int, avg_busbw: float, name: str) -> list:
    return [
        "# %-20s : %d %s" % ("Out of bounds values", num_failed_checks, "FAILED" if num_failed_checks else "OK"),
        ("# %-20s : %g" % ("Avg bus bandwidth", avg_busbw)),
        "#",
        f"# Collective test concluded: {name}",
    ]


def human_size(num_bytes: int) -> str:
    """8 -> '8B', 65536 -> '64K', 1073741824 -> '1G' (for plot ticks)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"


def nccl_version_code(version) -> int:
    """NCCL_VERSION_CODE of a version: (2, 28, 9) -> 22809, an int stays as is, None/unknown -> 0."""
    if version is None:
        return 0
    if isinstance(version, int):
        return version
    if isinstance(version, str):
        parts = version.split(".")
        if all(p.isdigit() for p in parts) and parts:
            version = tuple(int(p) for p in parts)
        else:
            return 0
    if isinstance(version, (tuple, list)) and len(version) >= 2 and all(isinstance(v, int) for v in version[:3]):
        major, minor = version[0], version[1]
        patch = version[2] if len(version) > 2 else 0
        # NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z before 2.9, X*10000+Y*100+Z since.
        return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch
    return 0
