"""Deterministic per-rank inputs and their closed-form expected outputs.

Input element i of rank r is a small integer, (i + 1009·r + 31·seed) mod k, chosen so that every
partial sum any reduction order can form is exact in the dtype (k shrinks with the rank count for
low-precision floats; integer types may wrap, which is exact too). prod uses values 1 and 2.
So results compare bit for bit, except avg, whose division rounds: compared within a tolerance.
Work is done in chunks so that checking an 8 GiB buffer needs only a few hundred MB more.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .ops.base import ALL, Segment

CHUNK = 1 << 24  # elements per generated/compared piece

# Largest L such that every integer in [0, L] is exact in the dtype.
_EXACT = {torch.float16: 2048, torch.bfloat16: 256, torch.float8_e4m3fn: 16, torch.float8_e5m2: 8,
          torch.float32: 1 << 24, torch.float64: 1 << 24}
_SIGNED_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def modulus(dtype: torch.dtype, redop: Optional[str], nranks: int) -> int:
    """k of the input pattern: inputs are 0..k-1."""
    if not _is_float(dtype):
        return 100  # wrap-around of integer sums is exact, so any k works; 100 fits int8
    limit = _EXACT[dtype]
    if redop in ("sum", "avg"):
        return max(1, limit // nranks + 1)  # n·(k-1) ≤ limit: every partial sum is exact
    return limit


def pattern(rank: int, start: int, length: int, dtype: torch.dtype, redop: Optional[str], nranks: int,
            seed: int, device) -> torch.Tensor:
    """Input elements [start, start+length) of `rank`, as `dtype`."""
    idx = torch.arange(start, start + length, dtype=torch.int64, device=device)
    if redop == "prod":
        # One rank in max(n, 2) contributes a 2 at each index: products stay exact (no overflow).
        vals = ((idx + rank + seed) % max(nranks, 2) == 0).to(torch.int64) + 1
    else:
        vals = (idx + 1009 * rank + 31 * seed) % modulus(dtype, redop, nranks)
    return _cast(vals, dtype)


def _cast(vals: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if _is_float(dtype):
        return vals.to(torch.float64).to(dtype) if dtype == torch.float64 else vals.to(torch.float32).to(dtype)
    return vals.to(dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).to(torch.float64) if _is_float(t.dtype) else t.to(torch.int64)


def fill_input(buf: torch.Tensor, rank: int, redop: Optional[str], nranks: int, seed: int) -> None:
    """Write rank `rank`'s input pattern into `buf` (a 1-D tensor)."""
    n = buf.numel()
    for s in range(0, n, CHUNK):
        m = min(CHUNK, n - s)
        buf[s:s + m].copy_(pattern(rank, s, m, buf.dtype, redop, nranks, seed, buf.device))


def fill_poison(buf: torch.Tensor) -> None:
    """All bytes 0xFF (NaN for floats, -1 / max for integers): never an expected value, so an op
    that leaves its output untouched is caught."""
    if buf.numel():
        buf.view(torch.uint8).fill_(0xFF)


def _expected_chunk(seg: Segment, s: int, m: int, dtype, redop, nranks, seed, device) -> torch.Tensor:
    """Expected values (in float64 or int64, not yet cast) of recv[seg.dst+s : seg.dst+s+m]."""
    if seg.src_rank != ALL:
        return _wide(pattern(seg.src_rank, seg.src + s, m, dtype, redop, nranks, seed, device))
    acc = None
    for r in range(nranks):
        v = _wide(pattern(r, seg.src + s, m, dtype, redop, nranks, seed, device))
        if acc is None:
            acc = v
        elif redop in ("sum", "avg"):
            acc += v
        elif redop == "prod":
            acc *= v
        elif redop == "max":
            acc = torch.maximum(acc, v)
        elif redop == "min":
            acc = torch.minimum(acc, v)
        else:
            raise ValueError(f"unknown redop {redop!r}")
    if redop == "avg":
        acc = acc / nranks
    return acc


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_SIGNED_BY_SIZE[t.element_size()])


def count_wrong(recv: torch.Tensor, segments: List[Segment], redop: Optional[str], nranks: int,
                seed: int) -> int:
    """Number of elements of `recv` that differ from what `segments` say they must hold."""
    dtype, device = recv.dtype, recv.device
    wrong = torch.zeros((), dtype=torch.int64, device=device)
    for seg in segments:
        for s in range(0, seg.length, CHUNK):
            m = min(CHUNK, seg.length - s)
            actual = recv[seg.dst + s: seg.dst + s + m]
            exp = _expected_chunk(seg, s, m, dtype, redop, nranks, seed, device)
            if redop == "avg" and _is_float(dtype):
                # avg rounds (NCCL may pre-scale by 1/n, gloo divides the sum): allow a few ulps.
                eps = torch.finfo(dtype).eps
                tol = (2 * nranks + 2) * eps * exp.abs().clamp(min=1.0)
                ok = (_wide(actual) - exp).abs() <= tol  # NaN compares False: counted as wrong
                wrong += (~ok).sum()
            else:
                wrong += (_bits(actual) != _bits(_cast_expected(exp, dtype))).sum()
    return int(wrong.item())


def _cast_expected(exp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if _is_float(dtype):
        return exp.to(dtype) if dtype == torch.float64 else exp.to(torch.float32).to(dtype)
    return exp.to(dtype)  # int64 -> narrower integer wraps, as the collective's arithmetic does


def corrupt(recv: torch.Tensor, segments: List[Segment]) -> None:
    """Testing only: flip a high bit of the first checked element, so the check must fail."""
    for seg in segments:
        if seg.length:
            elem = recv[seg.dst: seg.dst + 1].view(torch.uint8)
            elem[-1:].bitwise_xor_(0x40)  # most significant byte on little-endian machines
            return
