"""Memory accounting of model states (parameters, gradients, optimizer state), counted from
the distinct tensor storages a rank holds: this is what ZeRO's formulas (16Ψ, 4Ψ+12Ψ/N,
2Ψ+14Ψ/N, 16Ψ/N) count, and it works on CPU where there is no allocator to ask.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        n = s.nbytes()
        if n == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += n
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def held_bytes(model, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """{"params", "grads", "optim", "total"} in bytes, and "detail": bytes per role
    (params_full: compute-dtype full/gathered buffers, params_shard: master shards,
    grads_unreduced, grads_in_flight: reduce-scatter buffers, grads_shard, params_frozen)."""
    held = model._runtime.held_tensors()
    held["params_frozen"] = [info.frozen_master for info in model._param_infos]
    held["optim"] = list(optimizer_state_tensors(optimizer)) if optimizer is not None else []
    detail = {role: storage_bytes(tensors) for role, tensors in held.items()}
    out = {"params": storage_bytes(held["params_full"] + held["params_shard"] + held["params_frozen"]),
           "grads": storage_bytes(held["grads_unreduced"] + held["grads_in_flight"] + held["grads_shard"]),
           "optim": detail.pop("optim")}
    out["total"] = out["params"] + out["grads"] + out["optim"]
    out["detail"] = detail
    return out
