"""What pynccl DDP does when the constructor leaves a choice open (issue 26: a user who swaps the
import gets the fastest exact path with no flag). Each default was chosen by
benchmarks/ddp_bench.py's lever windows (benchmarks/RESULTS.md, "DDP").

gradient_as_bucket_view=None -> True: each parameter's .grad is a view into its bucket, so no
  pack into the bucket before the all-reduce and no unpack after it (the unpack sits at the end
  of backward, exposed). Bit-identical results; torch's own default is False. As in torch with
  the flag, .grad is the same tensor every step (a reference kept from the last step is
  overwritten). Pass False for torch's behaviour (a .grad of its own per parameter);
  PYNCCL_DDP_GRADIENT_AS_BUCKET_VIEW=0|1 decides where the constructor leaves it None.
tied_embedding_rows=None -> on where the model has an LM head tied to an embedding (GPT-2, nanoGPT):
  the head's part of the tied gradient is all-reduced at the start of backward and the rest
  crosses as the rows that carry it at the end (embedding_rows.py). Exact as torch DDP up to the
  order of one fp32 sum; .grad, torch.autograd.grad, backward(inputs=...), no_sync and a step
  whose loss skips the head behave as torch's. It steps aside (off for the model) where join(),
  overlap_optimizer(), another comm hook, a gradient hook on the tied weight or a CUDA graph
  capture need the plain path; tied_embedding_rows=True asks for it outright (those raise),
  False or PYNCCL_DDP_TIED_EMBEDDING_ROWS=0 turns it off.
  (Sessions 11-12 had it as an opt-in that detached the lookup instead: not exact where the
  lookup's part was needed outside DDP's reduction; this design keeps .grad torch's.)
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch.nn as nn

from .embedding_rows import tied_heads

TIED_ROWS_ENV = "PYNCCL_DDP_TIED_EMBEDDING_ROWS"
GRAD_VIEW_ENV = "PYNCCL_DDP_GRADIENT_AS_BUCKET_VIEW"


def _env_switch(name: str) -> Optional[bool]:
    """An 0/1 variable: None where unset or empty."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


def gradient_as_bucket_view(requested: Optional[bool]) -> bool:
    if requested is None:
        env = _env_switch(GRAD_VIEW_ENV)
        return True if env is None else env
    if not isinstance(requested, bool):
        raise TypeError(f"DistributedDataParallel: gradient_as_bucket_view must be a bool or None, got {requested!r}")
    return requested


def tied_embedding_rows(requested: Optional[bool], module: nn.Module) -> Tuple[list, bool]:
    """((LM head, its embeddings) pairs to handle, whether they were asked for outright). Empty: off."""
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f"DistributedDataParallel: tied_embedding_rows must be a bool or None, got {requested!r}")
    env = _env_switch(TIED_ROWS_ENV)
    on = requested if requested is not None else (True if env is None else env)
    return (tied_heads(module) if on else []), requested is True
