"""Reduction operators, numbered as the C++ extension expects them.

`ReduceOp` mirrors `torch.distributed.ReduceOp`; `PremulSum` carries the scale factor of a
pre-multiplied sum (NCCL's ncclRedOpCreatePreMulSum), built with `ReduceOp.premul_sum(f)`.
"""
import enum

import torch


class PremulSum:
    """sum_r(factor * x_r): one pass, the scale fused into the reduction."""

    __slots__ = ("factor",)

    def __init__(self, factor: float):
        if not isinstance(factor, (int, float)):
            raise TypeError(f"premul_sum: factor must be a Python float, got {type(factor).__name__}")
        self.factor = float(factor)

    def __repr__(self):
        return f"ReduceOp.premul_sum({self.factor})"


class ReduceOp(enum.IntEnum):
    # NOTE: the values are the C++ enum in csrc/dtypes.h; keep them in sync.
    SUM = 0
    PRODUCT = 1
    MAX = 2
    MIN = 3
    AVG = 4
    PREMUL_SUM = 5

    @staticmethod
    def premul_sum(factor: float) -> PremulSum:
        return PremulSum(factor)


_FLOAT_ONLY_OPS = (ReduceOp.AVG, ReduceOp.PREMUL_SUM)


def check_op_for_dtype(fn: str, op, dtype: torch.dtype):
    """Raise ValueError/TypeError when `op` is not a reduction `dtype` can take."""
    if isinstance(op, PremulSum):
        op_enum = ReduceOp.PREMUL_SUM
    else:
        try:
            op_enum = ReduceOp(op)
        except ValueError:
            raise ValueError(f"{fn}: op must be a pynccl.ReduceOp, got {op!r}") from None
    if op_enum in _FLOAT_ONLY_OPS and not dtype.is_floating_point:
        raise ValueError(f"{fn}: ReduceOp.{op_enum.name} needs a floating-point tensor, got {dtype}")
    return op_enum
