"""What the overlapped TP ops share (async_tp.py with sequence parallelism, async_tp_allreduce.py
without): which body runs (C++ on NCCL, the Python reference on gloo), GEMMs into views of their
outputs, F.linear's dtype under autocast, the weights' check, and the readers' output gradients as
the backward ops take them.
"""
from __future__ import annotations

from typing import List, Sequence

import torch


def native(g, name: str):
    """The C++ op of that name on g's NCCL communicator (csrc/tp_overlap.cpp), or None (gloo: the
    caller's Python, the same algorithm, is the reference the C++ one is tested against)."""
    return getattr(getattr(g.backend, "comm", None), name, None)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out (+)= a @ b, a (.., k), b (k, m), out (.., m); a and out may be strided sequence chunks
    of 3-D tensors (a batched GEMM with the batch stride as it is: no copy on CUDA)."""
    if a.is_contiguous() and out.is_contiguous():
        o2 = out.view(-1, out.shape[-1])
        a2 = a.view(-1, a.shape[-1])
        if accumulate:
            o2.addmm_(a2, b)
        else:
            torch.mm(a2, b, out=o2)
    elif a.dim() == 3 and out.dim() == 3:
        bb = b.expand(a.shape[0], *b.shape)  # (bsz, k, m), batch stride 0
        if accumulate:
            out.baddbmm_(a, bb)
        else:
            torch.bmm(a, bb, out=out)
    elif accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


def compute_dtype(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.dtype:
    """F.linear's dtype: autocast's where it is on for x's device, else x's (weights must match)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def check_weights(what: str, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    """ValueError naming the op unless every weight is (out, x's last dim) of x's dtype and device."""
    if x.dim() < 1:
        raise ValueError(f"pynccl::{what}: the input must have a feature dim, got shape {tuple(x.shape)}")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != x.shape[-1] or w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"pynccl::{what}: each weight must be (out, {x.shape[-1]}) of {x.dtype} on {x.device}; "
                             f"got {tuple(w.shape)} of {w.dtype} on {w.device}")


def dense_grads(grad_ys, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The readers' output gradients as the backward ops take them: zeros where autograd passed None
    (an output nobody used), shaped x @ w^T."""
    return [torch.zeros(x.shape[:-1] + (w.shape[0],), dtype=x.dtype, device=x.device) if gy is None else gy
            for gy, w in zip(grad_ys, weights)]
