"""TP without sequence parallelism, its all-reduces overlapped with the GEMMs (pynccl/tensor_parallel/
async_tp_allreduce.py, PYNCCL_TP_ASYNC=1), on gloo:

* the ops alone, fp64, at 2 and 3 ranks, each rank with its own weights and gradients (so every
  sum over ranks is a true sum): the readers' outputs, the replicated input's gradient summed over
  the ranks (from the outputs and from the input itself), every weight's gradient; the row-parallel
  product summed over the ranks in 1, 3 and more token slices than there are tokens, and its
  gradients; each op's fake and schema (opcheck), also with a transposed (Conv1D) weight; all of it
  with each way of summing (PYNCCL_TP_ASYNC_SUM: NCCL's all-reduce, or the partials all-gathered and
  summed locally);
  (PYNCCL_TP_ASYNC_CHUNKS: 0, the default, leaves the row-parallel all-reduce to the plain path;
  the plans run with the default and with 3 slices)
* by plan on Hugging Face models at TP 2 (no sequence parallelism): loss, logits and every gradient
  equal the unsharded model's within tests/test_tp_plan.py's fp32 bound, Llama (with and without
  activation checkpointing) and GPT-2 (fused, biased Conv1D), and the ops ran as often as the plan
  has readers and row-parallel projections;
* compiled whole (aot_eager): no graph break, the ops in the forward and backward graphs, the same
  values as eager;
* bad input raises ValueError naming what was expected.
"""
import collections
import os

import pytest
import torch

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.tensor_parallel import async_tp_allreduce as ar
from pynccl.testing import run_multiprocess
from numerics import assert_within, chain_rtol

transformers = pytest.importorskip("transformers")

from test_tp_plan import check_plan, gpt2_config, llama_config  # noqa: E402
from test_tp_async import autocast_case, compiled_llama_case  # noqa: E402

LAYERS = llama_config().num_hidden_layers


def _seeded(shape, seed, grad=False):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_(grad)


def _within(actual, expected, what, terms):
    """Two fp64 reduction orders over `terms` products: chain_rtol's bound, relative to the largest element."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_within(actual, expected, chain_rtol(terms, dtype=torch.float64) * expected.abs().max().item(), what)


def _ops_case(rank, world):
    group = pynccl.get_default_group()
    for mode in ("all_reduce", "gather"):
        os.environ[ar.SUM_ENV] = mode
        try:
            assert ar.sums_by_gather(group) == (mode == "gather")
            _sums_case(group, rank, world, mode)
        finally:
            os.environ.pop(ar.SUM_ENV, None)
    assert not ar.sums_by_gather(group), "auto on gloo: no copy engines, NCCL's all-reduce"
    assert ar.row_slices(10, 4) == [(0, 2), (2, 3), (5, 2), (7, 3)] and ar.row_slices(2, 5) == [(0, 1), (1, 1)]
    _error_case(group)
    return True


def _sums_case(group, rank, world, mode):
    for shape in ((3, 5, 8), (7, 8)):
        what = f"{world} ranks, {mode}, shape {shape}"
        # linears: x replicated (the same on every rank); each rank its own weights (shards), output
        # gradients and gradient of x itself, so x's gradient is a true sum over ranks
        x_whole = _seeded(shape, 0)
        widths = (5, 7)
        weights = [[_seeded((m, 8), 10 * k + i) for i, m in enumerate(widths)] for k in range(world)]
        grad_ys = [[_seeded(shape[:-1] + (m,), 100 + 10 * k + i) for i, m in enumerate(widths)] for k in range(world)]
        grad_xs = [_seeded(shape, 200 + k) for k in range(world)]
        x = x_whole.clone().requires_grad_()
        w_local = [w.clone().requires_grad_() for w in weights[rank]]
        x_out, ys = ar.linears(x, w_local, group)
        (sum((y * g).sum() for y, g in zip(ys, grad_ys[rank])) + (x_out * grad_xs[rank]).sum()).backward()
        assert torch.equal(x_out, x_whole), f"{what}: x passed through"
        for i, (y, w) in enumerate(zip(ys, weights[rank])):
            _within(y, x_whole @ w.t(), f"{what}: output {i}", 8)
        partial = [grad_xs[k] + sum(g @ w for g, w in zip(grad_ys[k], weights[k])) for k in range(world)]
        _within(x.grad, sum(partial), f"{what}: grad of x", (1 + sum(widths)) * world)
        for i, (w, g) in enumerate(zip(w_local, grad_ys[rank])):
            _within(w.grad, g.reshape(-1, g.shape[-1]).t() @ x_whole.reshape(-1, 8), f"{what}: grad of weight {i}",
                    x_whole.numel() // 8)
        # linear, then all-reduce: each rank its own h and weight; the output's gradient is whole
        # (the same on every rank), as a replicated output's is
        hs = [_seeded(shape[:-1] + (6,), 300 + k) for k in range(world)]
        ws = [_seeded((8, 6), 400 + k) for k in range(world)]
        total = sum(a @ b.t() for a, b in zip(hs, ws))
        rows = total.numel() // 8
        for chunks in (1, 3, rows + 2):
            h, w = hs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
            out = ar.linear_all_reduce(h, w, group, chunks)
            _within(out, total, f"{what}, {chunks} slices: summed output", 6 * world)
            grad_out = _seeded(out.shape, 500)
            (out * grad_out).sum().backward()
            _within(h.grad, grad_out @ ws[rank], f"{what}, {chunks} slices: grad of h", 8)
            _within(w.grad, grad_out.reshape(-1, 8).t() @ hs[rank].reshape(-1, 6), f"{what}: grad of w", rows)
    _unused_and_frozen_case(group, world, rank)
    _opcheck_case(group)


def _unused_and_frozen_case(group, world, rank):
    """An output nobody reads and x itself unread downstream: their gradients stay None (no zeros
    made and summed), and x's gradient is still every rank's sum. A frozen weight: worth_it sends
    the call to the plain path."""
    x_whole = _seeded((3, 8), 600)
    weights = [[_seeded((5, 8), 610 + 10 * k + i) for i in range(2)] for k in range(world)]
    grads = [_seeded((3, 5), 700 + k) for k in range(world)]
    x = x_whole.clone().requires_grad_()
    ws = [w.clone().requires_grad_() for w in weights[rank]]
    _, ys = ar.linears(x, ws, group)
    (ys[1] * grads[rank]).sum().backward()          # output 0 and x_out unused
    _within(x.grad, sum(g @ w[1] for g, w in zip(grads, weights)), "unused outputs: grad of x", 5 * world)
    assert ws[0].grad is None or not ws[0].grad.any(), "unused output 0: a weight gradient"
    assert ar.worth_it(x, ws) and not ar.worth_it(x, [ws[0], ws[1].detach()]) and not ar.worth_it(x.detach(), ws)
    with torch.no_grad():
        assert not ar.worth_it(x, ws)


def _opcheck_case(group):
    n, name = group.world_size, group.name
    x = _seeded((2, 4, 8), 5)
    w_t = _seeded((8, 6), 6).t()        # transposed, as a Conv1D layer's weight comes in
    for op, args in ((torch.ops.pynccl.tp_linears_all_reduce_backward.default,
                      (x, [_seeded((6, 8), 7)], [_seeded((2, 4, 6), 8)], None, n, name)),
                     (torch.ops.pynccl.tp_linears_all_reduce_backward.default,
                      (x, [w_t, _seeded((3, 8), 9)], [_seeded((2, 4, 6), 10), _seeded((2, 4, 3), 11)],
                       _seeded((2, 4, 8), 12), n, name)),
                     (torch.ops.pynccl.tp_linear_all_reduce.default, (_seeded((2, 4, 6), 13), _seeded((8, 6), 14),
                                                                      3, n, name)),
                     (torch.ops.pynccl.tp_linear_all_reduce.default, (_seeded((2, 4, 8), 15), w_t, 2, n, name))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="pynccl::tp_linear_all_reduce has no autograd formula"):
        torch.ops.pynccl.tp_linear_all_reduce(x.clone().requires_grad_(), _seeded((4, 8), 1), 2, n, name)


def _error_case(group):
    n, name = group.world_size, group.name
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"each weight must be \(out, 8\) of torch.float64"):
        torch.ops.pynccl.tp_linear_all_reduce(x, torch.randn(4, 8), 2, n, name)
    with pytest.raises(ValueError, match=r"each weight must be \(out, 8\) of torch.float64"):
        torch.ops.pynccl.tp_linears_all_reduce_backward(x, [torch.randn(4, 7, dtype=torch.float64)],
                                                        [torch.randn(2, 3, 4, dtype=torch.float64)], None, n, name)
    with pytest.raises(ValueError, match="one output gradient per weight, at least one; got 0 for 1 weights"):
        torch.ops.pynccl.tp_linears_all_reduce_backward(x, [torch.randn(4, 8, dtype=torch.float64)], [], None, n, name)
    with pytest.raises(ValueError, match="chunks must be >= 1, got 0"):
        torch.ops.pynccl.tp_linear_all_reduce(x, torch.randn(4, 8, dtype=torch.float64), 0, n, name)
    os.environ["PYNCCL_TP_ASYNC_CHUNKS"] = "-1"
    os.environ[ar.SUM_ENV] = "reduce"
    try:
        with pytest.raises(ValueError, match="PYNCCL_TP_ASYNC_CHUNKS must be a non-negative integer, got '-1'"):
            ar.chunks_requested()
        with pytest.raises(ValueError, match="PYNCCL_TP_ASYNC_SUM must be one of auto, gather, all_reduce, got 'reduce'"):
            torch.ops.pynccl.tp_linear_all_reduce(x, torch.randn(4, 8, dtype=torch.float64), 2, n, name)
    finally:
        os.environ.pop("PYNCCL_TP_ASYNC_CHUNKS", None)
        os.environ.pop(ar.SUM_ENV, None)


@pytest.mark.numerics
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_overlap_ops_match_the_whole_tensors_math(world):
    assert run_multiprocess(_ops_case, world, timeout=300) == [True] * world


class _Counted:
    """PYNCCL_TP_ASYNC=flag (unset: None) and PYNCCL_TP_ASYNC_CHUNKS=slices, if given, for the plans
    built inside, and how often each overlapped op ran."""

    def __init__(self, slices=None, flag="1"):
        self.slices, self.flag = slices, flag

    def __enter__(self):
        if self.flag is not None:
            os.environ["PYNCCL_TP_ASYNC"] = self.flag
        if self.slices is not None:
            os.environ["PYNCCL_TP_ASYNC_CHUNKS"] = str(self.slices)
        self.calls = collections.Counter()
        self._orig = (ar.linears, ar.linear_all_reduce)

        def counted(name, fn):
            def call(*a, **k):
                self.calls[name] += 1
                return fn(*a, **k)
            return call
        ar.linears, ar.linear_all_reduce = counted("linears", ar.linears), \
            counted("linear_all_reduce", ar.linear_all_reduce)
        return self

    def __exit__(self, *exc):
        os.environ.pop("PYNCCL_TP_ASYNC", None)
        os.environ.pop("PYNCCL_TP_ASYNC_CHUNKS", None)
        ar.linears, ar.linear_all_reduce = self._orig


def _plan_cases():
    # (what, config, plan, checkpointing, readers' nodes and row-parallel projections per forward).
    # Llama: each attention and MLP input with its projections, the LM head (a replicated input);
    # o_proj and down_proj. GPT-2: c_attn and c_fc, the LM head (tied to the vocabulary-parallel
    # embedding); the attention's and the MLP's c_proj.
    return [("llama", llama_config(use_cache=False), tp.plans.llama(), False, 2 * LAYERS + 1, 2 * LAYERS),
            ("llama, checkpointed", llama_config(use_cache=False), tp.plans.llama(), True,
             2 * LAYERS + 1, 2 * LAYERS),
            ("gpt2", gpt2_config(use_cache=False), tp.plans.gpt2(), False, 2 * LAYERS + 1, 2 * LAYERS)]


def _plan_case(rank, world):
    group = pynccl.get_default_group()
    # the default (0 slices: only the backward overlaps; the row-parallel all-reduce is the plain
    # one) and the forward in 3 token slices
    for slices in (None, 3):
        for what, config, plan, ckpt, readers, rows in _plan_cases():
            with _Counted(slices) as seen:
                check_plan(config, plan, group, f"{what}, async TP, {slices} slices", checkpointing=ckpt)
            rerun = LAYERS * 2 if ckpt else 0   # checkpointed layers run their forward again in backward
            expected = {"linears": readers + rerun, "linear_all_reduce": rows + rerun if slices else 0}
            assert {k: seen.calls[k] for k in expected} == expected, f"{what}, {slices} slices: {dict(seen.calls)}"
    os.environ[ar.SUM_ENV] = "gather"   # the partials gathered and summed locally, both ops (3 slices)
    try:
        what, config, plan, ckpt, _, _ = _plan_cases()[1]
        with _Counted(3) as seen:
            check_plan(config, plan, group, f"{what}, async TP, gathered sums", checkpointing=ckpt)
        assert seen.calls["linears"] > 0 and seen.calls["linear_all_reduce"] > 0, dict(seen.calls)
    finally:
        os.environ.pop(ar.SUM_ENV, None)
    _default_case(group)
    autocast_case(group, sequence_parallel=False)
    os.environ["PYNCCL_TP_ASYNC_CHUNKS"] = "3"   # and with the row-parallel all-reduce in slices (biased c_proj)
    try:
        autocast_case(group, sequence_parallel=False)
    finally:
        os.environ.pop("PYNCCL_TP_ASYNC_CHUNKS", None)
    return True


def _default_case(group):
    """PYNCCL_TP_ASYNC unset (auto): this overlap without sequence parallelism (forward and backward
    values as the plain path's, check_plan), none with it (async_tp.py's ops measured slower), none
    where PYNCCL_TP_GRAD_OVERLAP=1 asks for the eager overlap instead, none with PYNCCL_TP_ASYNC=0."""
    from pynccl.tensor_parallel import async_tp, grad_overlap
    config = llama_config(use_cache=False)
    for what, plan, flag, eager_overlap, expected in (
            ("default", tp.plans.llama(), None, False, 2 * LAYERS + 1),
            ("default, sequence parallel", tp.plans.llama(sequence_parallel=True), None, False, 0),
            ("default, PYNCCL_TP_GRAD_OVERLAP=1", tp.plans.llama(), None, True, 0),
            ("PYNCCL_TP_ASYNC=0", tp.plans.llama(), "0", False, 0)):
        sp_gathers = collections.Counter()
        original = async_tp.gather_linears

        def counted(*a, **k):
            sp_gathers["gather_linears"] += 1
            return original(*a, **k)
        async_tp.gather_linears = counted
        if eager_overlap:
            os.environ[grad_overlap.ENV] = "1"
        try:
            with _Counted(flag=flag) as seen:
                check_plan(config, plan, group, f"llama, {what}")
        finally:
            async_tp.gather_linears = original
            os.environ.pop(grad_overlap.ENV, None)
        assert seen.calls["linears"] == expected and not sp_gathers, f"{what}: {dict(seen.calls)}, {dict(sp_gathers)}"


@pytest.mark.numerics
def test_all_reduce_overlap_plans_equal_the_unsharded_model():
    assert run_multiprocess(_plan_case, 2, timeout=600) == [True, True]


def _compile_case(rank, world):
    # Forward: the embedding's all-reduce and the loss's two; each o_proj / down_proj's overlapped
    # all-reduce. Backward: every reader node's input-gradient all-reduce (two a layer, the LM head).
    fw = {"all_reduce": 3, "tp_linear_all_reduce": 2 * LAYERS}
    bw = {"tp_linears_all_reduce_backward": 2 * LAYERS + 1}
    compiled_llama_case(pynccl.get_default_group(), tp.plans.llama(),
                        {"PYNCCL_TP_ASYNC": "1", "PYNCCL_TP_ASYNC_CHUNKS": "3"},   # both ops in the graphs
                        "llama, async TP (all-reduce), compiled", fw, bw)
    return True


@pytest.mark.numerics
def test_all_reduce_overlap_compiles_without_graph_breaks():
    assert run_multiprocess(_compile_case, 2, timeout=600) == [True, True]


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_overlap_on_nccl(world):
    """On NCCL the ops run in C++ (csrc/tp_overlap.cpp), on a symmetric window where the group has
    one: each output and gradient equals the Python reference's bit for bit (the same GEMMs on the
    same slices; a sum of two fp32 terms is the same in any order), with NCCL's all-reduce and with
    the gathered partials (on the copy engines where the group has them); then the plans as on
    gloo, by default and with NCCL's all-reduce. At 4 ranks (the C++ sum of more than two partials)
    the gathered path only: NCCL's all-reduce of 4 terms sums in an order of its own per kernel."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    assert run_multiprocess(_gpu_case, world, backend="nccl", start_method="spawn", timeout=600) == [True] * world


def _gpu_case(rank, world):
    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 means fp32: the bounds are fp32's
    group = pynccl.get_default_group()
    device = pynccl.get_device(group)
    x = _seeded((3, 40, 64), 40).float().to(device)
    ws = [_seeded((32, 64), 41 + rank).float().to(device), _seeded((16, 64), 43 + rank).float().to(device)]
    h = _seeded((3, 40, 48), 45 + rank).float().to(device)
    w2 = _seeded((64, 48), 47 + rank).float().to(device)
    from pynccl.comm.symmetric import symmetric_support
    support = symmetric_support(group)
    for mode in ("all_reduce", "gather") if world == 2 else ("gather",):
        os.environ[ar.SUM_ENV] = mode
        try:
            runs = []
            for native in (True, False):
                original = ar.native
                if not native:
                    ar.native = lambda g, name: None
                try:
                    xr, wr = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
                    x_out, ys = ar.linears(xr, wr, group)
                    (sum((y * (i + 1 + rank)).sum() for i, y in enumerate(ys)) + x_out.sum()).backward()
                    hr, w2r = h.clone().requires_grad_(), w2.clone().requires_grad_()
                    out = ar.linear_all_reduce(hr, w2r, group, 3)
                    (out * out).sum().backward()
                    runs.append([*ys, xr.grad, *[w.grad for w in wr], out, hr.grad, w2r.grad])
                finally:
                    ar.native = original
            for i, (a, b) in enumerate(zip(*runs)):
                assert torch.equal(a, b), f"{mode}: C++ and Python differ in result {i}"
        finally:
            os.environ.pop(ar.SUM_ENV, None)
    if support.available:   # then the C++ side above ran on the windows
        for key in (ar._SCRATCH_KEY, ar._GATHER_KEY) if world == 2 else (ar._GATHER_KEY,):
            assert group._scratch_windows[key][0] is not None, f"no symmetric window {key}"
    assert ar.sums_by_gather(group) == support.copy_engine, "auto: gathered where the copy engines gather"
    if world != 2:   # the plans' test models split their heads in 2
        return True
    os.environ[ar.SUM_ENV] = "all_reduce"
    try:
        what, config, plan, ckpt, _, _ = _plan_cases()[0]
        with _Counted(3):
            check_plan(config, plan, group, f"{what}, async TP on NCCL, NCCL's all-reduce", device=device)
    finally:
        os.environ.pop(ar.SUM_ENV, None)
    for slices in (None, 3):
        for what, config, plan, ckpt, _, _ in _plan_cases():
            with _Counted(slices) as seen:
                check_plan(config, plan, group, f"{what}, async TP on NCCL, {slices} slices", device=device,
                           checkpointing=ckpt)
            assert seen.calls["linears"] > 0 and (seen.calls["linear_all_reduce"] > 0) == bool(slices), \
                dict(seen.calls)
    return True
