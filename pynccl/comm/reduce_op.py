"""Reduction operators: pynccl's `ReduceOp`, and `as_reduce_op`, which every entry point that takes
an op calls to accept torch's own objects.

torch users pass `torch.distributed.ReduceOp.MAX` (a `RedOpType`), `ReduceOp(RedOpType)` objects
and `_make_nccl_premul_sum(f)`; those are mapped by the member's identity (its name), never by
reading an integer. pynccl's members carry torch's values as well (SUM 0, AVG 1, PRODUCT 2, MIN 3,
MAX 4, ...), so `pynccl.ReduceOp.MAX == torch.distributed.ReduceOp.MAX` and the ints the C++
extension reads (csrc/dtypes.h) are the same numbers on both sides of every boundary.
"""
import enum

import torch

_FN = "op"


class PremulSum:
    """sum_r(factor * x_r): one pass, the scale fused into the reduction."""

    __slots__ = ("factor",)

    def __init__(self, factor: float):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"premul_sum: factor must be a Python float, got {type(factor).__name__}")
        self.factor = float(factor)

    def __repr__(self):
        return f"ReduceOp.premul_sum({self.factor})"

    def __eq__(self, other):
        other = _torch_premul(other) if _is_torch_op_object(other) else other
        return isinstance(other, PremulSum) and other.factor == self.factor

    def __hash__(self):
        return hash(("premul_sum", self.factor))


class ReduceOp(enum.IntEnum):
    # NOTE: torch.distributed.ReduceOp.RedOpType's values, and the C++ enum in csrc/dtypes.h: keep
    # all three in sync (tests/test_reduce_op.py checks the first two).
    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8

    @staticmethod
    def premul_sum(factor: float) -> PremulSum:
        return PremulSum(factor)

    def __eq__(self, other):
        if _is_torch_op_object(other):            # torch's RedOpType or ReduceOp(...): by member name
            red_op_type, _ = _torch_types()
            return self.name == (other if isinstance(other, red_op_type) else other.op).name
        return int.__eq__(self, other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = int.__hash__


_FLOAT_ONLY_OPS = (ReduceOp.AVG, ReduceOp.PREMUL_SUM)
_BITWISE_OPS = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
_EXPECTED = ("a pynccl.ReduceOp, a torch.distributed.ReduceOp (e.g. ReduceOp.MAX), "
             "ReduceOp.premul_sum(factor) or torch.distributed._make_nccl_premul_sum(factor)")


def _torch_types():
    """(RedOpType, ReduceOp class) of torch.distributed, or (None, None) where it is missing."""
    global _TORCH_TYPES
    if _TORCH_TYPES is None:
        try:
            import torch.distributed as tdist
            _TORCH_TYPES = (tdist.ReduceOp.RedOpType, tdist.ReduceOp)
        except (ImportError, AttributeError):
            _TORCH_TYPES = (None, None)
    return _TORCH_TYPES


_TORCH_TYPES = None


def _is_torch_op_object(op) -> bool:
    red_op_type, reduce_op_cls = _torch_types()
    return red_op_type is not None and isinstance(op, (red_op_type, reduce_op_cls))


def _torch_premul(op) -> PremulSum:
    """torch's PREMUL_SUM object (`_make_nccl_premul_sum(f)`): its factor as a PremulSum."""
    # NOTE: torch >= 2.14 has `.factor`; 2.11 only pickles it: __getstate__() is (PREMUL_SUM, factor).
    factor = op.factor if hasattr(op, "factor") else op.__getstate__()[1]
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"premul_sum: the factor tensor must have one element, got {factor.numel()}")
        factor = factor.item()            # NOTE: a host sync for a CUDA tensor; the op runs with the value
    return PremulSum(float(factor))


def as_reduce_op(op, fn: str = _FN):
    """`op` as a pynccl.ReduceOp or PremulSum; TypeError naming what is accepted otherwise.

    torch's members map by name (identity), so `torch.distributed.ReduceOp.MAX` is MAX whatever
    integer it carries; plain ints are refused, as torch.distributed refuses them."""
    if op.__class__ is ReduceOp or op.__class__ is PremulSum:
        return op
    red_op_type, reduce_op_cls = _torch_types()
    if red_op_type is not None:
        # NOTE: RedOpType first: isinstance(ReduceOp.MAX, torch.distributed.ReduceOp) is True too.
        if not isinstance(op, red_op_type) and isinstance(op, reduce_op_cls):
            if op.op == red_op_type.PREMUL_SUM:
                return _torch_premul(op)
            op = op.op
        if isinstance(op, red_op_type):
            member = ReduceOp.__members__.get(op.name)
            if member is None:
                raise ValueError(f"{fn}: torch.distributed.ReduceOp.{op.name} is not supported by pynccl")
            if member == ReduceOp.PREMUL_SUM:
                raise ValueError(f"{fn}: torch.distributed.ReduceOp.PREMUL_SUM needs its factor: pass "
                                 f"torch.distributed._make_nccl_premul_sum(factor) or ReduceOp.premul_sum(factor)")
            return member
    raise TypeError(f"{fn}: op must be {_EXPECTED}, got {op!r} ({type(op).__name__})")


def check_op_for_dtype(fn: str, op, dtype: torch.dtype):
    """`op` as a ReduceOp member (PREMUL_SUM for a premul op); ValueError/TypeError when it is not a
    reduction `dtype` can take."""
    op = as_reduce_op(op, fn)
    op_enum = ReduceOp.PREMUL_SUM if isinstance(op, PremulSum) else op
    if op_enum in _FLOAT_ONLY_OPS and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{fn}: ReduceOp.{op_enum.name} needs a floating-point tensor, got {dtype}")
    if op_enum in _BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{fn}: ReduceOp.{op_enum.name} needs an integer or bool tensor, got {dtype}")
    return op_enum
