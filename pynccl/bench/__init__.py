"""nccl-tests-style benchmarks of pynccl's collectives: `python -m pynccl.bench OP [flags]`.

Same flags, output, bandwidth formulas and checking as NVIDIA's nccl-tests, one small file per op
(pynccl/bench/ops/), one shared harness; optionally torch.distributed side by side in the same
processes (--impl both), a plot (--plot), and a parser for nccl-tests logs (pynccl.bench.parse).
"""
from .formatting import bandwidths, float_str
from .options import parse_size

__all__ = ["bandwidths", "float_str", "parse_size", "main"]


def main(argv=None):
    from .__main__ import main as _main
    return _main(argv)
