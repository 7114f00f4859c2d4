"""pynccl's collectives as torch custom ops (namespace `pynccl`), so torch.compile puts them in
its graphs instead of breaking there (the role of torch.distributed._functional_collectives).

Dynamo cannot trace a call into the backends (the C++ extension, the gloo backend's Python), so
every collective called from compiled code was a graph break: the model ran as many small graphs
and the autograd.Functions around the collectives ran eagerly, forward and backward. A custom op
is opaque to dynamo and AOTAutograd alike; its fake (shape, dtype, device of the result) is all
they need, so the forward and the backward collectives are nodes of the captured graphs.

The ops are functional: each returns a new tensor and leaves its input alone (a custom op may
not return an alias of its input). The group travels as its name (`ProcessGroup.name`, a string
dynamo bakes into the graph as a constant, as torch's functional collectives pass group names)
and is looked up among the live groups when the op runs; the group size is an argument too, so
the fakes need no group.

    pynccl::all_reduce(Tensor x, str reduce_op, str group_name) -> Tensor
    pynccl::all_gather_into_tensor(Tensor x, int group_size, str group_name) -> Tensor   (dim 0)
    pynccl::reduce_scatter_tensor(Tensor x, str reduce_op, int group_size, str group_name) -> Tensor

Callers use `all_reduce` / `all_gather` / `reduce_scatter` below, which pick the path: eager
calls go straight to the collective (in place where it can be, as before: a custom op call costs
several µs of dispatch per call, see docs/design.md), code dynamo traces
(`torch.compiler.is_compiling()`) gets the op. The result is what callers use; whether it is
the input's storage differs between the two paths.
"""
from __future__ import annotations

import torch

from . import collectives
from .groups import resolve_group
from .process_group import _state
from .reduce_op import ReduceOp

_REDUCE_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
               "product": ReduceOp.PRODUCT}


def group_name(group) -> str:
    """The traceable stand-in for `group` (None: the default group): its name."""
    return resolve_group(group).name


def group_by_name(name: str):
    """The live group called `name` (the newest, should a destroyed group's name come back)."""
    for g in reversed(_state.groups):
        if g.name == name:
            return g
    raise ValueError(f"pynccl custom op: no live process group named {name!r}; live groups: "
                     f"{[g.name for g in _state.groups]}")


def _reduce_op(name: str) -> ReduceOp:
    op = _REDUCE_OPS.get(name)
    if op is None:
        raise ValueError(f"pynccl custom op: reduce_op must be one of {sorted(_REDUCE_OPS)}, got {name!r}")
    return op


def _checked_group(name: str, group_size: int):
    g = group_by_name(name)
    if g.world_size != group_size:
        raise ValueError(f"pynccl custom op: group {name!r} has {g.world_size} ranks, the op was traced for "
                         f"{group_size}")
    return g


def _scaled_dim0(x: torch.Tensor, numerator: int, denominator: int, what: str):
    if x.dim() == 0 or (x.shape[0] * numerator) % denominator:
        raise ValueError(f"pynccl::{what}: dim 0 of the input (shape {tuple(x.shape)}) must be divisible by the "
                         f"group size ({denominator})")
    return (x.shape[0] * numerator // denominator,) + tuple(x.shape[1:])


# ----------------------------------------------------------------------------------- the ops
_LIB = torch.library.Library("pynccl", "DEF")  # NOTE: kept alive here: the ops live as long as it does


def define_op(schema: str, impl, fake):
    """pynccl::<name> from its schema, its kernel (every device: CompositeExplicitAutograd) and its
    fake, through torch.library's low-level API; returns the OpOverload. The ops carry no autograd
    formula: callers wrap them in autograd.Functions (comm.py, async_tp.py), which dynamo traces.
    NOTE: not torch.library.custom_op: its per-call autograd layer and aliasing check cost 34-41 µs
    of host per call against 21-23 µs here (all_reduce on NCCL, 2xH200, session 19), and a compiled
    sequence-parallel tp 2 step of Llama 1.1B calls these ops 161 times (RESULTS, tensor parallelism)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"pynccl::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.pynccl, name).default

    def no_autograd(keyset, *args):
        # NOTE: without this kernel torch only warns and passes the gradient through unchanged (an
        # all-reduce's gradient would come back un-summed). ~2 µs a call.
        if torch.is_grad_enabled() and any(_requires_grad(a) for a in args):
            raise RuntimeError(f"pynccl::{name} has no autograd formula; call it inside an autograd.Function "
                               f"(as pynccl.tensor_parallel does) or under torch.no_grad()")
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
    _LIB.impl(name, no_autograd, "Autograd", with_keyset=True)
    return op


def _requires_grad(a) -> bool:
    if isinstance(a, torch.Tensor):
        return a.requires_grad
    return isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in a)


def _all_reduce(x, reduce_op, group_name):
    # NOTE: out of place (NCCL reads x, writes out): a clone then an in-place all-reduce copied every
    # traced all-reduce's input once more, 2.2 ms of a compiled tp 2 step of Llama 1.1B on 2xH100
    # (RESULTS, tensor parallelism). The backend takes output=; collectives.all_reduce mirrors
    # torch's signature, which has none.
    x = x.contiguous()
    out = torch.empty_like(x)
    group_by_name(group_name).backend.all_reduce(x, _reduce_op(reduce_op), False, output=out)
    return out


def _all_gather(x, group_size, group_name):
    g = _checked_group(group_name, group_size)
    out = x.new_empty(_scaled_dim0(x, group_size, 1, "all_gather_into_tensor"))
    collectives.all_gather_into_tensor(out, x.contiguous(), group=g)
    return out


def _reduce_scatter(x, reduce_op, group_size, group_name):
    g = _checked_group(group_name, group_size)
    out = x.new_empty(_scaled_dim0(x, 1, group_size, "reduce_scatter_tensor"))
    collectives.reduce_scatter_tensor(out, x.contiguous(), _reduce_op(reduce_op), group=g)
    return out


all_reduce_op = define_op(
    "all_reduce(Tensor x, str reduce_op, str group_name) -> Tensor", _all_reduce,
    lambda x, reduce_op, group_name: torch.empty_like(x, memory_format=torch.contiguous_format))
all_gather_op = define_op(
    "all_gather_into_tensor(Tensor x, int group_size, str group_name) -> Tensor", _all_gather,
    lambda x, group_size, group_name: x.new_empty(_scaled_dim0(x, group_size, 1, "all_gather_into_tensor")))
reduce_scatter_op = define_op(
    "reduce_scatter_tensor(Tensor x, str reduce_op, int group_size, str group_name) -> Tensor", _reduce_scatter,
    lambda x, reduce_op, group_size, group_name: x.new_empty(_scaled_dim0(x, 1, group_size,
                                                                          "reduce_scatter_tensor")))


# ------------------------------------------------------------------- eager or traced, one call
def all_reduce(x: torch.Tensor, group=None, reduce_op: str = "sum") -> torch.Tensor:
    """x reduced over `group`. Eager: in place on x, which must be contiguous and the caller's to
    overwrite; traced: a new tensor. Use the result either way."""
    if torch.compiler.is_compiling():
        return all_reduce_op(x, reduce_op, group_name(group))
    collectives.all_reduce(x, _reduce_op(reduce_op), group=group)
    return x


def all_gather(x: torch.Tensor, group=None, async_op: bool = False):
    """(n, ...) -> (size * n, ...), rank r's x at [r*n, (r+1)*n). With async_op, (output, Work);
    traced, the Work is None (a Work cannot be traced: the op is synchronous in the graph)."""
    g = resolve_group(group)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        out = all_gather_op(x, g.world_size, g.name)
        return (out, None) if async_op else out
    out = x.new_empty((g.world_size * x.shape[0],) + tuple(x.shape[1:]))
    work = collectives.all_gather_into_tensor(out, x, group=g, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter(x: torch.Tensor, group=None, async_op: bool = False, reduce_op: str = "sum"):
    """(size * n, ...) -> (n, ...), rank r keeping the reduction of every rank's [r*n, (r+1)*n).
    With async_op, (output, Work); traced, the Work is None (as all_gather)."""
    g = resolve_group(group)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        out = reduce_scatter_op(x, reduce_op, g.world_size, g.name)
        return (out, None) if async_op else out
    out = x.new_empty((x.shape[0] // g.world_size,) + tuple(x.shape[1:]))
    work = collectives.reduce_scatter_tensor(out, x, _reduce_op(reduce_op), group=g, async_op=async_op)
    return (out, work) if async_op else out


def all_reduce_async(x: torch.Tensor, group=None):
    """(x summed over `group` in place, Work) eager; (a new tensor, None) traced. x contiguous."""
    if torch.compiler.is_compiling():
        return all_reduce_op(x, "sum", group_name(group)), None
    return x, collectives.all_reduce(x, ReduceOp.SUM, group=group, async_op=True)
