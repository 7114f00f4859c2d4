"""Collective mismatch detection (PYNCCL_CHECK_COLLECTIVES=1 or init option).

Before each collective every rank publishes (sequence number, op, dtype, count, root) in
the store and reads everyone else's; a difference raises CollectiveMismatchError on every
rank, naming the ranks and what differed — the case NCCL itself can only hang on. A rank
that never publishes is named in a CommTimeoutError. It wraps a Backend, so with the check
off there is no cost at all. Point-to-point ops are not checked (they pair two ranks, not
the group).
"""
from __future__ import annotations

import datetime
import json
from typing import Optional

import torch

from ..errors import CollectiveMismatchError, CommTimeoutError
from .reduce_op import PremulSum, ReduceOp, as_reduce_op


def _op_name(op) -> Optional[str]:
    if op is None:
        return None
    try:
        op = as_reduce_op(op)
    except (TypeError, ValueError):
        return repr(op)                   # the backend raises the error itself, after the check
    return f"PREMUL_SUM({op.factor})" if isinstance(op, PremulSum) else op.name


class CheckedBackend:
    """Delegates everything to `inner`, verifying each collective's signature first."""

    def __init__(self, inner, store, group_name: str, key_prefix: str):
        self._inner = inner
        self._store = store
        # NOTE: key_prefix carries the init's generation: a store reused by a later init must
        # never hand this group an earlier init's signatures.
        self._prefix = f"{key_prefix}/check/{group_name}"
        self._group_name = group_name
        self._seq = 0
        self._variant = None              # tag_next_collective: compared with the next signature

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _verify(self, op: str, tensor: Optional[torch.Tensor], reduce_op=None, root: Optional[int] = None):
        self._seq += 1
        seq, rank, n = self._seq, self._inner.rank, self._inner.world_size
        sig = {"op": op, "dtype": str(tensor.dtype) if tensor is not None else None,
               "count": tensor.numel() if tensor is not None else 0,
               "redop": _op_name(reduce_op), "root": root}
        if self._variant is not None:
            sig["variant"], self._variant = self._variant, None
        self._store.set(f"{self._prefix}/{seq}/{rank}", json.dumps(sig))
        keys = [f"{self._prefix}/{seq}/{r}" for r in range(n)]
        timeout = datetime.timedelta(seconds=self._inner.timeout_s)
        try:
            self._store.wait(keys, timeout)
        except Exception as e:  # noqa: BLE001 - turned into a named time-out
            missing = [r for r in range(n) if not self._store.check([keys[r]])]
            raise CommTimeoutError(
                f"{op} (seq {seq}) on group '{self._group_name}': ranks {missing} never reached this collective "
                f"within {self._inner.timeout_s:.1f}s (collective check)") from e
        sigs = [json.loads(v) for v in self._store.multi_get(keys)]
        if seq > 1:
            self._store.delete_key(f"{self._prefix}/{seq - 1}/{rank}")
        if any(s != sigs[0] for s in sigs):
            fields = sorted({k for s in sigs for k in s if s[k] != sigs[0][k]})
            by_rank = "; ".join(f"rank {r}: " + ", ".join(f"{k}={s[k]}" for k in ("op",) + tuple(
                f for f in fields if f != "op")) for r, s in enumerate(sigs))
            raise CollectiveMismatchError(
                f"collective #{seq} on group '{self._group_name}' differs across ranks in {', '.join(fields)}: "
                f"{by_rank}")

    # --- collectives: check, then delegate --------------------------------------------
    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False, output=None):
        self._verify("all_reduce", tensor, op)
        return self._inner.all_reduce(tensor, op, async_op, output=output)

    def broadcast(self, tensor, root, async_op=False, output=None):
        self._verify("broadcast", tensor, root=root)
        return self._inner.broadcast(tensor, root, async_op, output=output)

    def reduce(self, tensor, root, op=ReduceOp.SUM, async_op=False, output=None):
        self._verify("reduce", tensor, op, root)
        return self._inner.reduce(tensor, root, op, async_op, output=output)

    def all_gather(self, output_list, input, async_op=False):
        self._verify("all_gather", input)
        return self._inner.all_gather(output_list, input, async_op)

    def all_gather_into_tensor(self, output, input, async_op=False):
        self._verify("all_gather_into_tensor", input)
        return self._inner.all_gather_into_tensor(output, input, async_op)

    def reduce_scatter(self, output, input_list, op=ReduceOp.SUM, async_op=False):
        self._verify("reduce_scatter", output, op)
        return self._inner.reduce_scatter(output, input_list, op, async_op)

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op=False):
        self._verify("reduce_scatter_tensor", output, op)
        return self._inner.reduce_scatter_tensor(output, input, op, async_op)

    def all_to_all(self, output_list, input_list, async_op=False):
        self._verify("all_to_all", input_list[0] if input_list else None)
        return self._inner.all_to_all(output_list, input_list, async_op)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, async_op=False):
        # Split sizes legitimately differ per rank: compare op and dtype only.
        self._verify("all_to_all_single", input[:0])
        return self._inner.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)

    def gather(self, input, gather_list, root, async_op=False):
        self._verify("gather", input, root=root)
        return self._inner.gather(input, gather_list, root, async_op)

    def scatter(self, output, scatter_list, root, async_op=False):
        self._verify("scatter", output, root=root)
        return self._inner.scatter(output, scatter_list, root, async_op)

    def barrier(self):
        self._verify("barrier", None)
        return self._inner.barrier()

    def barrier_work(self):
        self._verify("barrier", None)   # the same signature as barrier(): ranks may mix the two, as in torch
        return self._inner.barrier_work()


def tag_next_collective(backend, variant: str) -> None:
    """With the check on, the next collective's signature carries `variant` (a choice the caller
    made locally that must be the same on every rank, e.g. whether ZeRO-3's all-gather runs in a
    symmetric window): a difference raises CollectiveMismatchError instead of a hang. Free when
    the check is off."""
    if isinstance(backend, CheckedBackend):
        backend._variant = variant
