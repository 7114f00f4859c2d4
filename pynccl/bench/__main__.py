"""`python -m pynccl.bench OP [flags]` (console script `pynccl-bench`): nccl-tests' flags and
output for pynccl's collectives. See pynccl/bench/options.py for the flags."""
from __future__ import annotations

import os
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from .options import parse_args
    opts = parse_args(argv)
    # NOTE: NCCL reads these when a communicator is created: set them before any rank starts.
    if opts.algo:
        os.environ["NCCL_ALGO"] = opts.algo
    if opts.proto:
        os.environ["NCCL_PROTO"] = opts.proto
    if opts.plot:
        from .plot import require_matplotlib
        require_matplotlib()
    import torch
    backend = opts.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    from .launch import launch
    try:
        return launch(opts, backend)
    except ValueError as e:
        print(f"pynccl.bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
