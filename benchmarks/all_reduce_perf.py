#!/usr/bin/env python3
"""nccl-tests' all_reduce_perf on pynccl: same flags, same output. `all_reduce_perf.py -h` lists the flags;
`python -m pynccl.bench all_reduce ...` is the same command."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from pynccl.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["all_reduce", *sys.argv[1:]]))
