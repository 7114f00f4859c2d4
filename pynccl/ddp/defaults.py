"""What pynccl DDP does when the constructor leaves a choice open (issue 26: a user who swaps the
import gets the fastest exact path with no flag). Each default was chosen by
benchmarks/ddp_bench.py's lever windows (benchmarks/RESULTS.md, "DDP").

gradient_as_bucket_view=None -> True: each parameter's .grad is a view into its bucket, so no
  pack into the bucket before the all-reduce and no unpack after it (the unpack sits at the end
  of backward, exposed). Bit-identical results; torch's own default is False. Pass False for
  torch's behaviour (a .grad of its own per parameter); PYNCCL_DDP_GRADIENT_AS_BUCKET_VIEW=0|1
  decides where the constructor leaves it None.
tied_embedding_rows=None -> on where the group communicates over NCCL and the model has a tied
  embedding (embedding_rows.py): the head's part of the tied weight's gradient is all-reduced
  during backward, the lookup's part exchanged as rows at its end. The same sums in another fp32
  order. Chosen on, it steps aside instead of refusing: join(), overlap_optimizer(), a comm hook
  other than pynccl's built-in ones or a gradient hook on the tied weight turn it off for the
  model. PYNCCL_DDP_TIED_EMBEDDING_ROWS=0 turns it off, =1 on for any backend (still stepping
  aside); tied_embedding_rows=True asks for it outright (those calls then raise).
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch.nn as nn

from .embedding_rows import tied_embeddings

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


def tied_embedding_rows(requested: Optional[bool], module: nn.Module,
                        backend_name: str) -> Tuple[List[nn.Embedding], bool]:
    """(the embeddings to handle, whether they were asked for outright). An empty list: off."""
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f"DistributedDataParallel: tied_embedding_rows must be a bool or None, got {requested!r}")
    if requested is not None:
        return (tied_embeddings(module) if requested else []), requested
    env = _env_switch(TIED_ROWS_ENV)
    on = env if env is not None else backend_name == "nccl"
    return (tied_embeddings(module) if on else []), False
