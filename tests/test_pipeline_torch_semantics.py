"""pynccl.pipeline against torch.distributed.pipelining in the same 2 gloo ranks, where swapping one
for the other with the same arguments could silently change results: every body builds the same
fp64 MLP's stages through torch's PipelineStage / schedules and through pynccl's, steps both on the
same data, and compares what a user sees: step()'s return value, the `losses` list, every
parameter's .grad, the input's .grad.

Exact comparisons: both sides run the same fp64 kernels on the same micro-batch views (dim-0
chunks), and accumulate each parameter's gradient over micro-batches in the same order (0 first);
torch divides the accumulated .grad by n_microbatches after the step, which for 2 and 4 (powers of
two) is exact. So any difference is a different computation, not rounding.

Divergences this file found (each test below failed on the code before its fix):
* the `losses` list: torch replaces its contents with the step's losses (losses.clear(), then one per
  micro-batch); pynccl appended them, so a list reused across steps grew (and losses[0] was stale).
* gradient scaling: torch backwards the unscaled loss and divides each stage parameter's .grad by
  n_microbatches after the step; pynccl divided the loss before backward. Gradients left from an
  earlier step (no zero_grad: accumulation across steps) were then not divided, and the .grad of
  an input that requires grad (not a stage parameter: torch leaves it unscaled) was divided.
* a last stage returning a tuple (or list) of one tensor: torch passes the module's output as is to
  loss_fn and merges step()'s return value in the same structure; pynccl passed the bare tensor
  (a loss_fn indexing output[0] took the first row instead) and returned the bare tensor.
* torch's positional arguments: pynccl's 4th was scale_grads, so torch's args_chunk_spec=None there
  silently turned the 1/n_microbatches off (and 5 or more were a TypeError).
* forwards only: loss_fn=None (torch: step() runs forwards only) was a TypeError and eval() did not
  exist; step() under torch.no_grad() (torch: RuntimeError on every rank before anything runs) failed
  in the last stage's backward, mid-step, leaving the other ranks waiting for its gradients.
* step()'s keyword inputs (torch splits them into micro-batches for the stage modules),
  return_outputs and loss_kwargs were TypeErrors; torch's pre-split arg_mbs / target_mbs are refused
  (ValueError) rather than taken for keyword inputs; tensors nested in list / dict keyword inputs are
  split leaf by leaf as torch's (the first version of the keyword support repeated the whole list).
"""
import copy
import inspect

import pytest
import torch
import torch.distributed as tdist
import torch.distributed.pipelining as tpp
from torch import nn

import pynccl.pipeline as ppp
from pynccl.pipeline import ScheduleKind, check
from pynccl.testing import run_multiprocess

P = 2            # pipeline ranks
WIDTH = 4
BATCH = 8
mse = nn.functional.mse_loss
SIDES = (("torch", tpp), ("pynccl", ppp))
KINDS = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1), "interleaved": ("ScheduleInterleaved1F1B", 2)}


# ----------------------------------------------------------------------------- helpers
def _model(num_stages, seed=0):
    """num_stages parts of Linear+Tanh pairs (the last stage ends on a Linear), fp64."""
    torch.manual_seed(seed)
    parts = []
    for k in range(num_stages):
        layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
        if k < num_stages - 1:
            layers.append(nn.Tanh())
        parts.append(nn.Sequential(*layers).double())
    return parts


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64))


def _schedule(lib, kind, rank, mods, m, loss_fn, *args, **kwargs):
    """lib's schedule of `kind` over this rank's stage modules (stage k on rank k % P)."""
    cls_name, v = KINDS[kind]
    num_stages = P * v
    indices = list(range(rank, num_stages, P))
    if lib is tpp:
        stages = [tpp.PipelineStage(mods[k], k, num_stages, torch.device("cpu")) for k in indices]
    else:
        stages = [ppp.PipelineStage(mods[k], k, num_stages) for k in indices]
    return getattr(lib, cls_name)(stages if v > 1 else stages[0], m, loss_fn, *args, **kwargs)


def _both(rank, kind, body, make_parts=_model):
    """{side: body(schedule factory, this rank's modules)}: each side on its own copy of the model."""
    _, v = KINDS[kind]
    parts = make_parts(P * v)
    seen = {}
    for name, lib in SIDES:
        mods = copy.deepcopy(parts)
        mine = [mods[k] for k in range(rank, P * v, P)]
        seen[name] = body(lambda m, loss_fn=mse, *a, **kw: _schedule(lib, kind, rank, mods, m, loss_fn, *a, **kw), mine)
        tdist.barrier()
    return seen


def _grads(mods):
    return [None if p.grad is None else p.grad.clone() for mod in mods for p in mod.parameters()]


def _same(a, b):
    """Equal structure and bit-equal tensors (see the module docstring: no rounding to allow for)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a.detach(), b.detach())
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _assert_same(seen, what):
    assert _same(seen["pynccl"], seen["torch"]), f"{what}:\npynccl {seen['pynccl']}\ntorch  {seen['torch']}"


def _step(sched, rank, x, y, losses, **kwargs):
    """The documented call: inputs on the first stage's rank, target and losses on the last's."""
    if rank == 0:
        return sched.step(x, **kwargs)
    return sched.step(target=y, losses=losses, **kwargs)


# ----------------------------------------------------------------------------- a step, fresh gradients
def _fresh_step(rank, ws, kind):
    x, y = _data()
    for m in (2, 4):
        for scale_grads in (True, False):
            def body(make, mods):
                sched = make(m, scale_grads=scale_grads)
                losses = []
                out = _step(sched, rank, x, y, losses)
                return [out, [loss.detach() for loss in losses], _grads(mods)]
            _assert_same(_both(rank, kind, body), f"{kind} m={m} scale_grads={scale_grads} rank {rank}")
    return True


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_step_as_torch(kind):
    """One step from zero gradients: the merged output, the per-micro-batch losses and every
    parameter's gradient, with and without scale_grads."""
    assert run_multiprocess(_fresh_step, P, timeout=60, args=(kind,)) == [True] * P


# ----------------------------------------------------------------------------- the losses list
def _losses_list(rank, ws):
    x, y = _data()
    for kind in ("gpipe", "1f1b"):
        def body(make, mods):
            sched = make(2)
            losses = ["from the caller"]
            seen = []
            for _ in range(2):                       # one list reused across steps
                _step(sched, rank, x, y, losses)
                seen.append([loss.detach() if isinstance(loss, torch.Tensor) else loss for loss in losses])
            return seen
        _assert_same(_both(rank, kind, body), f"{kind} losses rank {rank}")
    return True


def test_losses_list_is_replaced_as_torch():
    """torch clears `losses` and fills it with this step's losses (the last stage's rank only)."""
    assert run_multiprocess(_losses_list, P, timeout=60) == [True] * P


# ----------------------------------------------------------------------------- gradient scaling
def _grad_scaling(rank, ws):
    x, y = _data()
    for kind in ("gpipe", "1f1b", "interleaved"):
        for m in (2, 4):
            def body(make, mods):
                sched = make(m)
                seen = []
                for _ in range(2):                   # no zero_grad between the steps: accumulation
                    xi = x.clone().requires_grad_(True)
                    _step(sched, rank, xi, y, [])
                    seen.append([_grads(mods), xi.grad])
                return seen
            _assert_same(_both(rank, kind, body), f"{kind} m={m} accumulated grads rank {rank}")
    return True


def test_gradients_scaled_as_torch():
    """scale_grads divides each stage parameter's .grad by n_microbatches after the step, as
    torch's perform_reduce_grad: gradients accumulated from an earlier step are divided too, and an
    input's .grad (not a stage parameter) is left unscaled."""
    assert run_multiprocess(_grad_scaling, P, timeout=60) == [True] * P


# ----------------------------------------------------------------------------- output structure
class _Wrap(nn.Module):
    """The last stage returning its output inside a tuple or a list."""

    def __init__(self, inner, container):
        super().__init__()
        self.inner, self.container = inner, container

    def forward(self, x):
        return self.container([self.inner(x)])


def _index_loss(out, target):
    # Written for a module returning a container: out[0] is the tensor (on a bare tensor: its first row).
    return mse(out[0], target)


def _output_structure(rank, ws):
    x, y = _data()
    for container in (tuple, list):
        def make_parts(n):
            parts = _model(n)
            parts[-1] = _Wrap(parts[-1], container)
            return parts
        for kind in ("gpipe", "1f1b"):
            def body(make, mods):
                sched = make(2, loss_fn=_index_loss)
                losses = []
                out = _step(sched, rank, x, y, losses)
                return [out, [loss.detach() for loss in losses], _grads(mods)]
            _assert_same(_both(rank, kind, body, make_parts), f"{kind} {container.__name__} output rank {rank}")
    return True


def test_last_stage_output_structure_as_torch():
    """loss_fn gets the last stage module's output as returned (a 1-tuple stays a tuple), and
    step() returns the merged output in that structure."""
    assert run_multiprocess(_output_structure, P, timeout=60) == [True] * P


# ----------------------------------------------------------------------------- forwards only
def _error(fn):
    """The type of what fn() raised, or None."""
    try:
        fn()
    except Exception as e:                        # noqa: BLE001 - compared with torch's
        return type(e)
    return None


def _forward_only(rank, ws):
    x, y = _data()
    for kind in sorted(KINDS):
        def body(make, mods):
            seen = []
            sched = make(4, loss_fn=None)            # no loss_fn: step() runs forwards only
            seen.append([_step(sched, rank, x, y, None), _grads(mods)])
            # losses= without a loss_fn: RuntimeError on the last stage's rank, after the step
            seen.append(_error(lambda: _step(sched, rank, x, y, [])))
            # NOTE: a step before eval(): torch 2.11 cannot train a schedule whose first call was eval()
            sched = make(4)
            for call in ("step", "eval", "no_grad", "step"):
                for mod in mods:
                    mod.zero_grad(set_to_none=True)
                losses = []
                if call == "no_grad":                # step() backwards: refused under no_grad, on every rank
                    with torch.no_grad():
                        seen.append(_error(lambda: _step(sched, rank, x, y, losses)))
                    continue
                run = sched.step if call == "step" else sched.eval
                out = run(x) if rank == 0 else run(target=y, losses=losses)
                seen.append([out, [loss.detach() for loss in losses], _grads(mods)])
            return seen
        _assert_same(_both(rank, kind, body), f"{kind} forwards only rank {rank}")
    return True


def test_forward_only_as_torch():
    """loss_fn=None and eval(): the forwards only (the same output, losses with a loss_fn, no
    gradients), as torch; step() under torch.no_grad() raises RuntimeError on every rank, and the
    schedule steps as usual afterwards."""
    assert run_multiprocess(_forward_only, P, timeout=60) == [True] * P


def _positional(rank, ws):
    x, y = _data()

    # torch's order: loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads
    for args in ((None,), (None, None, None, False)):
        def body(make, mods):
            sched = make(2, mse, *args)
            losses = []
            return [_step(sched, rank, x, y, losses), [loss.detach() for loss in losses], _grads(mods)]
        _assert_same(_both(rank, "1f1b", body), f"positional arguments {args} rank {rank}")
    return True


def test_positional_arguments_as_torch():
    """Schedules take torch's arguments in torch's order (pynccl's 4th positional argument was
    scale_grads: torch's args_chunk_spec=None there silently turned the 1/n_microbatches off)."""
    assert run_multiprocess(_positional, P, timeout=60) == [True] * P


def test_forward_only_programs_are_deadlock_free():
    """eval()'s programs (each schedule's forwards in its order) under the checker's rendezvous model."""
    for kind in ScheduleKind:
        for p in (2, 3, 4):
            for v in ((2, 3) if kind is ScheduleKind.INTERLEAVED_1F1B else (1,)):
                for m in range(p if kind is ScheduleKind.INTERLEAVED_1F1B else 1, 13, p if v > 1 else 1):
                    res = check(kind, p, m, v, forward_only=True)
                    assert all(peak == m * v for peak in res.peak_live.values()), (kind, p, v, m, res.peak_live)


# ----------------------------------------------------------------------------- step()'s other arguments
class _Scaled(nn.Module):
    """A stage taking keyword inputs: a per-sample scale (split into micro-batches) and a float shift
    (the same for every micro-batch)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, scale=None, shift=0.0):
        y = self.inner(x)
        return (y if scale is None else y * scale) + shift


def _weighted_mse(out, target, weight=1.0):
    return weight * mse(out, target)


def _step_arguments(rank, ws):
    x, y = _data()
    scale = torch.linspace(0.5, 1.5, BATCH, dtype=torch.float64).unsqueeze(1)
    # loss_kwargs: torch 2.14 on (2.11's step() has none)
    loss_kwargs = {"weight": 0.25} if "loss_kwargs" in inspect.signature(tpp.Schedule1F1B.step).parameters else {}
    for kind in sorted(KINDS):
        def body(make, mods):
            sched = make(4, loss_fn=_weighted_mse)
            seen = []
            for return_outputs in (True, False):
                for mod in mods:
                    mod.zero_grad(set_to_none=True)
                losses = []
                # keyword inputs on every rank: each rank's stages get them (torch: forward_one_chunk's kwargs)
                if rank == 0:
                    out = sched.step(x, scale=scale, shift=0.5, return_outputs=return_outputs)
                else:
                    out = sched.step(target=y, losses=losses, scale=scale, shift=0.5, return_outputs=return_outputs,
                                     **({"loss_kwargs": loss_kwargs} if loss_kwargs else {}))
                seen.append([out, [loss.detach() for loss in losses], _grads(mods)])
            return seen
        _assert_same(_both(rank, kind, body, lambda n: [_Scaled(part) for part in _model(n)]),
                     f"{kind} keyword inputs rank {rank}")
    # torch's pre-split micro-batches: refused on every rank before anything runs (not passed on as
    # keyword inputs to the module); the schedule steps as usual afterwards
    sched = _schedule(ppp, "1f1b", rank, _model(P), 2, mse)
    with pytest.raises(ValueError, match="pre-split micro-batches"):
        sched.step(arg_mbs=[(x[:4],), (x[4:],)], target_mbs=[y[:4], y[4:]])
    assert (_step(sched, rank, x, y, []) is None) == (rank == 0)
    return True


def test_step_keyword_arguments_as_torch():
    """step(x, **kwargs): keyword inputs split along dim 0 (other values repeated) to every stage of
    the rank; return_outputs=False returns None; loss_kwargs reach loss_fn; pre-split micro-batches
    (arg_mbs, target_mbs) raise ValueError."""
    assert run_multiprocess(_step_arguments, P, timeout=60) == [True] * P


# ----------------------------------------------------------------------------- nested inputs
class _Nested(nn.Module):
    """A first stage taking keyword inputs nested in a list and a dict (torch: positional inputs are
    tensors, keyword inputs any tree)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, more=(), extra=None):
        x = x + 0.5 * sum(more)
        if extra is not None:
            x = x * extra["scale"] + extra["shift"]
        return self.inner(x)


def _nested_inputs(rank, ws):
    x, y = _data()
    x2, _ = _data(seed=2)
    extra = {"scale": torch.linspace(0.5, 1.5, BATCH, dtype=torch.float64).unsqueeze(1), "shift": 0.25}

    def make_parts(n):
        parts = _model(n)
        parts[0] = _Nested(parts[0])
        return parts
    for kind in ("gpipe", "1f1b"):
        def body(make, mods):
            sched = make(4)
            losses = []
            out = sched.step(x, more=[x2, x2 * 2], extra=extra) if rank == 0 else sched.step(target=y, losses=losses)
            return [out, [loss.detach() for loss in losses], _grads(mods)]
        _assert_same(_both(rank, kind, body, make_parts), f"{kind} nested inputs rank {rank}")
    return True


def test_nested_inputs_split_as_torch():
    """Tensors inside list and dict keyword inputs are split into micro-batches leaf by leaf (torch's
    default chunk spec, a tree map), other leaves repeated."""
    assert run_multiprocess(_nested_inputs, P, timeout=60) == [True] * P
