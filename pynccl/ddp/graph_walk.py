"""Which leaf tensors a forward's output reaches through its autograd graph: DDP's
find_unused_parameters / static_graph bookkeeping (torch DDP walks the graph the same way)."""
from __future__ import annotations

from typing import List

import torch


def _flatten_tensors(obj, out: List[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _flatten_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _flatten_tensors(o, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for f in obj.__dataclass_fields__:
            _flatten_tensors(getattr(obj, f), out)


def params_reached(output) -> set:
    """ids of the leaf tensors the autograd graph of `output` reaches (torch DDP's traversal)."""
    tensors: List[torch.Tensor] = []
    _flatten_tensors(output, tensors)
    reached = {id(t) for t in tensors if t.requires_grad and t.grad_fn is None}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)   # AccumulateGrad
        if variable is not None:
            reached.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return reached
