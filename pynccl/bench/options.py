"""Command-line flags of the benchmark: nccl-tests' letters and defaults, plus pynccl's own
(--nproc, --nnodes, --backend, --impl, --algo/--proto, --plot, --reps).

Flag values parse as nccl-tests parses them (sizes with K/M/G suffixes, 1024-based; integers
with strtol(..., 0), so 0x10 works), so a command line copied from an nccl-tests run works here.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

# nccl-tests type names, in nccl-tests' order; "-d all" runs them all (a backend that lacks one
# says so and the benchmark skips it).
DTYPES = {
    "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "uint32": torch.uint32,
    "int64": torch.int64, "uint64": torch.uint64, "half": torch.float16, "float": torch.float32,
    "double": torch.float64, "bfloat16": torch.bfloat16,
    "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2,
}
REDOPS = ("sum", "prod", "max", "min", "avg")
IMPLS = ("pynccl", "torch", "both")
ALGOS = ("ring", "tree", "nvls", "nvlstree", "collnetdirect", "collnetchain", "pat")
PROTOS = ("LL", "LL128", "Simple")
# The deliberate-corruption switch the tests use to prove that wrong results are caught.
CORRUPT_ENV = "PYNCCL_BENCH_CORRUPT"

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'8', '64K', '1.5M', '1G' -> bytes (1024-based, case-insensitive), as nccl-tests' parsesize."""
    s = str(text).strip()
    unit = 1
    if s and s[-1].lower() in _UNITS:
        unit = _UNITS[s[-1].lower()]
        s = s[:-1].strip()
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"invalid size {text!r}: expected a number of bytes with an optional K, M or G "
                         f"suffix (1024-based), e.g. 8, 64K, 1G") from None
    if value < 0:
        raise ValueError(f"invalid size {text!r}: sizes must be ≥ 0")
    return int(value * unit)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_arg(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _choice_list(name: str, choices, text: str) -> List[str]:
    if text == "all":
        return list(choices)
    if text not in choices:
        raise argparse.ArgumentTypeError(f"unknown {name} {text!r}; expected one of {', '.join(choices)} or all")
    return [text]


def build_parser() -> argparse.ArgumentParser:
    from .ops import OP_NAMES
    p = argparse.ArgumentParser(
        prog="python -m pynccl.bench",
        description="nccl-tests-style collective benchmark for pynccl (same flags, output and bandwidth "
                    "formulas as NVIDIA's nccl-tests), optionally side by side with torch.distributed.",
        epilog=f"OP is one of {', '.join(OP_NAMES)}, a comma-separated list of them, or all. "
               f"Testing only: {CORRUPT_ENV}=1 corrupts every checked result, to prove that wrong values "
               f"are reported (#wrong > 0) and make the run exit non-zero.")
    p.add_argument("op", metavar="OP", help="collective(s) to run")
    g = p.add_argument_group("nccl-tests flags")
    g.add_argument("-b", "--minbytes", type=_size_arg, default=32 << 20, help="min size in bytes (32M)")
    g.add_argument("-e", "--maxbytes", type=_size_arg, default=32 << 20, help="max size in bytes (32M)")
    g.add_argument("-i", "--stepbytes", type=_size_arg, default=1 << 20,
                   help="additive step when -f ≤ 1 (1M)")
    g.add_argument("-f", "--stepfactor", type=_int_arg, default=1, help="multiplicative step (1: use -i)")
    g.add_argument("-n", "--iters", type=_int_arg, default=20, help="timed iterations (20)")
    g.add_argument("-w", "--warmup_iters", type=_int_arg, default=1, help="warm-up iterations (1)")
    g.add_argument("-c", "--check", type=_int_arg, default=1,
                   help="check iterations (1; 0 skips checking and prints N/A for #wrong)")
    g.add_argument("-o", "--op", dest="redop", default="sum",
                   type=lambda s: _choice_list("redop", REDOPS, s), help="sum|prod|max|min|avg|all (sum)")
    g.add_argument("-d", "--datatype", default="float",
                   type=lambda s: _choice_list("datatype", list(DTYPES), s),
                   help=f"{'|'.join(DTYPES)}|all (float)")
    g.add_argument("-r", "--root", type=_int_arg, default=0, help="root rank (0; -1 loops over all ranks)")
    g.add_argument("-z", "--blocking", type=_int_arg, nargs="?", const=1, default=0,
                   help="1: wait for completion and barrier after each op; 2: wait only (0)")
    g.add_argument("-G", "--cudagraph", type=_int_arg, default=0,
                   help="capture the -n ops in a CUDA graph and replay it this many times (0: no graph)")
    g.add_argument("-C", "--report_cputime", type=_int_arg, nargs="?", const=1, default=0,
                   help="1: the time column is the host (CPU) time to enqueue one op (0)")
    g.add_argument("-a", "--average", type=_int_arg, default=1, choices=(0, 1, 2, 3),
                   help="combine rank times: 0 rank 0, 1 mean, 2 min, 3 max (1)")
    g.add_argument("-J", "--json", default=None, metavar="FILE.json",
                   help="also write the results as JSON (nccl-tests' layout); {op} is replaced by the op name")
    x = p.add_argument_group("pynccl flags")
    x.add_argument("--nproc", type=_int_arg, default=None,
                   help="start this many ranks (one per GPU on nccl); without it, run as one rank or under torchrun")
    x.add_argument("--nnodes", type=_int_arg, default=None,
                   help="run as this many nodes on this host: one torchrun agent each with --nproc ranks "
                        "(default 1), NCCL on its socket transport and gloo over loopback, as between hosts "
                        "without InfiniBand (pynccl.testing.multinode)")
    x.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="nccl (CUDA tensors) or gloo (CPU tensors); default nccl if CUDA is available")
    x.add_argument("--impl", choices=IMPLS, default="pynccl",
                   help="pynccl, torch (torch.distributed), or both in the same processes with a comparison table")
    x.add_argument("--algo", choices=ALGOS, default=None, help="sets NCCL_ALGO for the run")
    x.add_argument("--proto", choices=PROTOS, default=None, help="sets NCCL_PROTO for the run")
    x.add_argument("--reps", type=_int_arg, default=1,
                   help="time each cell this many times (impls alternating) and report the median (1)")
    x.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot busbw and time per op against size (needs matplotlib); {op} is replaced")
    x.add_argument("--timeout", type=float, default=600.0, help="seconds any rank may wait for the others (600)")
    x.add_argument("--corrupt", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and validate; argparse errors exit with status 2 and a usage line, as usual."""
    from .ops import OP_NAMES
    parser = build_parser()
    opts = parser.parse_args(argv)
    ops = OP_NAMES if opts.op == "all" else [o.strip() for o in opts.op.split(",") if o.strip()]
    for name in ops:
        if name not in OP_NAMES:
            parser.error(f"unknown OP {name!r}; expected one of {', '.join(OP_NAMES)}, a comma-separated list, or all")
    opts.ops = ops
    if opts.minbytes > opts.maxbytes:
        parser.error(f"invalid sizes for 'minbytes' and 'maxbytes': {opts.minbytes} > {opts.maxbytes}")
    if opts.stepfactor <= 1 and opts.stepbytes <= 0:
        parser.error("-i (stepbytes) must be > 0 when -f (stepfactor) is ≤ 1")
    if opts.stepfactor > 1 and opts.minbytes == 0:
        parser.error("-b 0 with -f > 1 would never grow; give -b ≥ 1")
    for flag, value, low in (("-n", opts.iters, 1), ("-w", opts.warmup_iters, 0), ("-c", opts.check, 0),
                             ("-G", opts.cudagraph, 0), ("--reps", opts.reps, 1), ("-z", opts.blocking, 0),
                             ("-C", opts.report_cputime, 0)):
        if value < low:
            parser.error(f"{flag} must be ≥ {low}, got {value}")
    if opts.cudagraph and opts.blocking:
        parser.error("-G (CUDA graph) and -z (blocking) exclude each other: a graph cannot wait on the host")
    if opts.nproc is not None and opts.nproc < 1:
        parser.error(f"--nproc must be ≥ 1, got {opts.nproc}")
    if opts.nnodes is not None and opts.nnodes < 1:
        parser.error(f"--nnodes must be ≥ 1, got {opts.nnodes}")
    opts.argv = list(argv) if argv is not None else sys.argv[1:]
    multi = len(ops) > 1
    for flag, path in (("-J", opts.json), ("--plot", opts.plot)):
        if path and multi and "{op}" not in path:
            parser.error(f"{flag} {path!r}: with several OPs the path must contain {{op}}, e.g. out/{{op}}.json")
    opts.corrupt = opts.corrupt or os.environ.get(CORRUPT_ENV, "") not in ("", "0")
    return opts


def size_steps(opts) -> List[int]:
    """The sizes of the sweep, as nccl-tests walks them."""
    sizes = []
    size = opts.minbytes
    while size <= opts.maxbytes:
        sizes.append(size)
        size = size * opts.stepfactor if opts.stepfactor > 1 else size + opts.stepbytes
    return sizes
