"""Sequence-parallel TP with its collectives overlapped with the GEMMs (pynccl/tensor_parallel/
async_tp.py, PYNCCL_TP_ASYNC=1), on gloo:

* the ops alone, fp64, at 2 and 3 ranks (3: the ring order of the partials' exchange), sequence
  dim 0 ([s, b, h]: chunks contiguous) and 1 ([b, s, h]: strided chunks), against the same math on
  the whole tensors: gathered input, every output, the input's and every weight's gradient;
  the reduce-scatter's output and both gradients; each op's fake and schema (opcheck);
* by plan on Hugging Face models at TP 2 (sequence parallelism on): loss, logits and every gradient
  equal the unsharded model's within tests/test_tp_plan.py's fp32 bound, Llama (with and without
  activation checkpointing) and GPT-2 (fused, biased Conv1D), and the ops really ran, as many
  times as the plan has blocks;
* compiled whole (aot_eager): no graph break, one graph, the ops in the forward and backward
  graphs, the same values as eager;
* the switch and bad input raise ValueError naming what was expected.
"""
import collections
import copy
import os

import pytest
import torch

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.tensor_parallel import async_tp
from pynccl.testing import run_multiprocess
from numerics import assert_within, chain_rtol

transformers = pytest.importorskip("transformers")

from test_tp_plan import FP32_TOL, check_plan, gpt2_config, llama_config  # noqa: E402
from test_tp_compile import _compiled, llama_compiled_equals_eager  # noqa: E402

LAYERS = 2  # llama_config's / gpt2_config's


def _seeded(shape, seed, grad=False):
    t = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_() if grad else t


def _within(actual, expected, what, terms):
    """Two fp64 reduction orders over `terms` products: chain_rtol's bound, relative to the largest element."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_within(actual, expected, chain_rtol(terms, dtype=torch.float64) * expected.abs().max().item(), what)


def _ops_case(rank, world):
    group = pynccl.get_default_group()
    for seq_dim, shape in ((1, (3, 4 * world, 8)), (0, (4 * world, 3, 8)), (1, (1, 2 * world, 8))):
        s = shape[seq_dim] // world
        what = f"{world} ranks, seq_dim {seq_dim}, shape {shape}"
        # gather, then two linears: one whole x sharded over the ranks; each rank its own weights and
        # output gradients, so x's gradient is a true sum over ranks (every rank's partial differs)
        x_whole = _seeded(shape, 0)
        widths = (5, 7)
        weights = [[_seeded((m, 8), 10 * k + i) for i, m in enumerate(widths)] for k in range(world)]
        grad_ys = [[_seeded(shape[:-1] + (m,), 100 + 10 * k + i) for i, m in enumerate(widths)] for k in range(world)]
        grad_x_fulls = [_seeded(shape, 200 + k) for k in range(world)]  # readers that used x_full itself
        x = x_whole.narrow(seq_dim, rank * s, s).clone().requires_grad_()
        w_local = [w.clone().requires_grad_() for w in weights[rank]]
        x_full, ys = async_tp.gather_linears(x, w_local, group, seq_dim)
        (sum((y * g).sum() for y, g in zip(ys, grad_ys[rank])) + (x_full * grad_x_fulls[rank]).sum()).backward()
        assert torch.equal(x_full, x_whole), f"{what}: gathered input"
        for i, (y, w) in enumerate(zip(ys, weights[rank])):
            _within(y, x_whole @ w.t(), f"{what}: output {i}", 8)
        partial = [grad_x_fulls[k] + sum(g @ w for g, w in zip(grad_ys[k], weights[k])) for k in range(world)]
        _within(x.grad, sum(partial).narrow(seq_dim, rank * s, s), f"{what}: grad of x", (1 + sum(widths)) * world)
        for i, (w, g) in enumerate(zip(w_local, grad_ys[rank])):
            _within(w.grad, g.reshape(-1, g.shape[-1]).t() @ x_whole.reshape(-1, 8), f"{what}: grad of weight {i}",
                    x_whole.numel() // 8)
        # linear, then reduce-scatter: each rank its own h and weight
        hs = [_seeded(shape[:-1] + (6,), 100 + k) for k in range(world)]
        ws = [_seeded((8, 6), 200 + k) for k in range(world)]
        h, w = hs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        out = async_tp.linear_reduce_scatter(h, w, group, seq_dim)
        total = sum(a @ b.t() for a, b in zip(hs, ws))
        _within(out, total.narrow(seq_dim, rank * s, s), f"{what}: reduce-scatter output", 6 * world)
        grad_outs = [_seeded(out.shape, 300 + k) for k in range(world)]
        (out * grad_outs[rank]).sum().backward()
        grad_whole = torch.cat(grad_outs, seq_dim)          # (.., s·world, .., 8)
        _within(h.grad, grad_whole @ ws[rank], f"{what}: grad of h", 8)
        _within(w.grad, grad_whole.reshape(-1, 8).t() @ hs[rank].reshape(-1, 6), f"{what}: grad of w",
                grad_whole.numel() // 8)
    _opcheck_case(group)
    _error_case(group)
    return True


def _opcheck_case(group):
    n, name = group.world_size, group.name
    x = _seeded((2, 4, 8), 5 + group.group_rank)
    w = _seeded((6, 8), 6)
    h = _seeded((2, 4 * n, 6), 7)
    w2 = _seeded((8, 6), 8)
    x_full = _seeded((2, 4 * n, 8), 9)
    w_t = _seeded((8, 6), 6).t()        # transposed, as a Conv1D layer's weight comes in
    for op, args in ((torch.ops.pynccl.tp_gather_linears.default, (x, [w], 1, n, name)),
                     (torch.ops.pynccl.tp_gather_linears.default, (x, [w_t], 1, n, name)),
                     (torch.ops.pynccl.tp_gather_linears_backward.default,
                      (x_full, [w_t], [_seeded((2, 4 * n, 6), 10)], None, 1, n, name)),
                     (torch.ops.pynccl.tp_linear_reduce_scatter.default, (h, w2, 1, n, name)),
                     (torch.ops.pynccl.tp_linear_reduce_scatter_backward.default,
                      (_seeded((2, 4, 8), 11), h, w2.t().contiguous().t(), 1, n, name)),
                     (torch.ops.pynccl.tp_linear_reduce_scatter_backward.default,
                      (_seeded((2, 4, 6), 12), _seeded((2, 4 * n, 8), 13), w_t, 1, n, name))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    # the ops carry no autograd formula: called on a tensor that requires grad, outside an
    # autograd.Function, they refuse (torch's fallback would pass the gradient through un-summed)
    with pytest.raises(RuntimeError, match="pynccl::all_reduce has no autograd formula"):
        torch.ops.pynccl.all_reduce(x.clone().requires_grad_(), "sum", name)


def _error_case(group):
    n, name = group.world_size, group.name
    x = torch.randn(2, 3 * n + 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="must be divisible by the tensor-parallel size"):
        torch.ops.pynccl.tp_linear_reduce_scatter(x, torch.randn(4, 8, dtype=torch.float64), 1, n, name)
    with pytest.raises(ValueError, match=r"each weight must be \(out, 8\) of torch.float64"):
        torch.ops.pynccl.tp_gather_linears(x, [torch.randn(4, 8)], 1, n, name)
    with pytest.raises(ValueError, match="seq_dim 2 must name a dim before the last"):
        torch.ops.pynccl.tp_gather_linears(x, [torch.randn(4, 8, dtype=torch.float64)], 2, n, name)
    with pytest.raises(ValueError, match=r"seq_dim 3 is out of range for an input of shape \(2, "):
        async_tp.linear_reduce_scatter(x, torch.randn(4, 8, dtype=torch.float64), group, 3)


def test_native_ops_get_the_window_their_exchange_fills():
    """On NCCL each C++ op is handed the group's window where the chunks travel on the copy engines
    (PYNCCL_TP_ASYNC_SUM auto/gather), of the bytes its exchange writes: world_size chunks for an
    all-gather, 2 x world_size chunks of the partials for the all-to-all (the C++ body refuses a
    smaller one); with `all_reduce` none (NCCL's kernels on ordinary memory). Checked on gloo with
    the C++ bodies and the window stood in for."""
    assert run_multiprocess(_window_case, 3, timeout=120) == [True] * 3


class _Handed(Exception):
    pass


def _window_case(rank, world):
    group = pynccl.get_default_group()
    n, name = world, group.name
    x, w = _seeded((2, 4, 8), 1), _seeded((6, 8), 2)          # this rank's chunk (seq_dim 1), a weight
    x_full, h = _seeded((2, 4 * n, 8), 3), _seeded((2, 4 * n, 5), 4)
    w2, go = _seeded((8, 5), 5), _seeded((2, 4, 8), 6)
    size = x.element_size()
    cases = {  # op: (its arguments, the bytes its exchange writes)
        "tp_gather_linears": ((x, [w], 1, n, name), n * x.numel() * size),
        "tp_gather_linears_backward": ((x_full, [w], [_seeded((2, 4 * n, 6), 7)], None, 1, n, name),
                                       2 * x_full.numel() * size),
        "tp_linear_reduce_scatter": ((h, w2, 1, n, name), 2 * n * (2 * 4 * 8) * size),
        "tp_linear_reduce_scatter_backward": ((go, h, w2, 1, n, name), n * go.numel() * size),
    }
    asked = []

    def window(g, key, nbytes):
        asked.append((key, nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def body(*args):
        raise _Handed(args[-1])

    original = (async_tp.native, async_tp.scratch_window)
    async_tp.native, async_tp.scratch_window = (lambda g, op: body), window
    try:
        for mode in ("gather", "all_reduce"):
            os.environ["PYNCCL_TP_ASYNC_SUM"] = mode
            for op, (args, nbytes) in cases.items():
                asked.clear()
                with pytest.raises(_Handed) as handed:
                    getattr(torch.ops.pynccl, op)(*args)
                scratch = handed.value.args[0]
                if mode == "all_reduce":
                    assert scratch is None and not asked, (op, asked)
                else:
                    assert asked == [(async_tp._EXCHANGE_KEY, nbytes)], (op, asked, nbytes)
                    assert scratch is not None and scratch.numel() == nbytes, op
    finally:
        os.environ.pop("PYNCCL_TP_ASYNC_SUM", None)
        async_tp.native, async_tp.scratch_window = original
    return True


@pytest.mark.numerics
@pytest.mark.parametrize("world", [2, 3])
def test_async_tp_ops_match_the_whole_tensors_math(world):
    assert run_multiprocess(_ops_case, world, timeout=300) == [True] * world


class _Counted:
    """PYNCCL_TP_ASYNC=1 for the plans built inside, and how often each overlapped op ran."""

    def __enter__(self):
        os.environ["PYNCCL_TP_ASYNC"] = "1"
        self.calls = collections.Counter()
        self._orig = (async_tp.gather_linears, async_tp.linear_reduce_scatter)
        gather, scatter = self._orig

        def counted_gather(*a, **k):
            self.calls["gather_linears"] += 1
            return gather(*a, **k)

        def counted_scatter(*a, **k):
            self.calls["linear_reduce_scatter"] += 1
            return scatter(*a, **k)
        async_tp.gather_linears, async_tp.linear_reduce_scatter = counted_gather, counted_scatter
        return self

    def __exit__(self, *exc):
        os.environ.pop("PYNCCL_TP_ASYNC", None)
        async_tp.gather_linears, async_tp.linear_reduce_scatter = self._orig


def _plan_case(rank, world):
    group = pynccl.get_default_group()
    # (what, config, plan, checkpointing, gathers and reduce-scatters per forward)
    # Llama: each attention and MLP input gathered with its projections, the LM head's input too;
    # each o_proj / down_proj reduce-scattered. GPT-2: the LM head reads the gathered final norm.
    cases = [("llama", llama_config(use_cache=False), tp.plans.llama(sequence_parallel=True), False,
              2 * LAYERS + 1, 2 * LAYERS),
             ("llama, checkpointed", llama_config(use_cache=False), tp.plans.llama(sequence_parallel=True), True,
              2 * LAYERS + 1, 2 * LAYERS),
             ("gpt2", gpt2_config(use_cache=False), tp.plans.gpt2(sequence_parallel=True), False,
              2 * LAYERS, 2 * LAYERS)]
    for what, config, plan, ckpt, gathers, scatters in cases:
        with _Counted() as seen:
            check_plan(config, plan, group, f"{what}, async TP", checkpointing=ckpt)
        rerun = LAYERS * 2 if ckpt else 0   # checkpointed layers run their forward again in backward
        assert seen.calls == {"gather_linears": gathers + rerun, "linear_reduce_scatter": scatters + rerun}, \
            f"{what}: {dict(seen.calls)}"
    autocast_case(group)
    _other_readers_case(group)
    # the switch is read when the plan is applied
    os.environ["PYNCCL_TP_ASYNC"] = "2"
    try:
        with pytest.raises(ValueError, match="PYNCCL_TP_ASYNC must be auto, 0 or 1, got '2'"):
            tp.parallelize_module(transformers.LlamaForCausalLM(llama_config()), group,
                                  tp.plans.llama(sequence_parallel=True))
    finally:
        os.environ.pop("PYNCCL_TP_ASYNC", None)
    return True


def autocast_case(group, sequence_parallel=True):
    """Under bf16 autocast the outputs have the plain path's dtypes (a biased reader's output is
    F.linear's bf16, not promoted by an fp32 bias) and the loss agrees within bf16's rounding of the
    model's reduction chain (the overlap gathers and sums x's gradient in bf16, the plain path in fp32).
    Also tests/test_tp_async_allreduce.py's, without sequence parallelism."""
    config = gpt2_config(use_cache=False)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config)
    x = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    runs = {}
    for flag in ("0", "1"):
        os.environ["PYNCCL_TP_ASYNC"] = flag
        try:
            par = tp.parallelize_module(copy.deepcopy(ref), group, tp.plans.gpt2(sequence_parallel=sequence_parallel))
        finally:
            os.environ.pop("PYNCCL_TP_ASYNC", None)
        seen = {}
        hook = par.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, a, o: seen.setdefault("c_attn", o))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = par(input_ids=x, labels=x)
        hook.remove()
        runs[flag] = (out.loss.float().item(), out.logits.dtype, seen["c_attn"].dtype)
    assert runs["1"][1:] == runs["0"][1:], f"dtypes under autocast: async {runs['1'][1:]}, plain {runs['0'][1:]}"
    from test_tp_plan import BATCH, SEQ_LEN, VOCAB
    from numerics import transformer_rtol
    bound = transformer_rtol(2, 64, 256, 16, SEQ_LEN, VOCAB, BATCH * SEQ_LEN, dtype=torch.bfloat16)
    assert abs(runs["1"][0] - runs["0"][0]) <= bound * abs(runs["0"][0]), f"loss under autocast: {runs}, bound {bound}"


class _LowRankBlock(torch.nn.Module):
    """A block whose column-parallel `up` reads another layer's output, not the block's input."""

    def __init__(self):
        super().__init__()
        self.down, self.up, self.out = torch.nn.Linear(16, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.up(self.down(x)))


def _other_readers_case(group):
    """A ColwiseParallel layer that does not read the gathered input is left to its own forward."""
    from test_tp_plan import SEQ_LEN
    torch.manual_seed(3)
    ref = _LowRankBlock()
    plan = {"": tp.PrepareModuleInput(input_layouts=(tp.Shard(1),), desired_input_layouts=(tp.Replicate(),)),
            "down": tp.ColwiseParallel(output_layouts=tp.Replicate()), "up": tp.ColwiseParallel(),
            "out": tp.RowwiseParallel(output_layouts=tp.Shard(1))}
    x = torch.randn(2, SEQ_LEN, 16, generator=torch.Generator().manual_seed(4))
    n, r = group.world_size, group.group_rank
    shard = x.chunk(n, 1)[r]
    outs = {}
    for flag in ("0", "1"):
        os.environ["PYNCCL_TP_ASYNC"] = flag
        try:
            par = tp.parallelize_module(copy.deepcopy(ref), group, plan)
        finally:
            os.environ.pop("PYNCCL_TP_ASYNC", None)
        outs[flag] = par(shard)
    expected = ref(x).chunk(n, 1)[r]
    for flag, out in outs.items():
        assert_within(out, expected, FP32_TOL * expected.abs().max().item(), f"low-rank block, PYNCCL_TP_ASYNC={flag}")


@pytest.mark.numerics
def test_async_tp_plans_equal_the_unsharded_model():
    assert run_multiprocess(_plan_case, 2, timeout=600) == [True, True]


def compiled_llama_case(group, plan, env, what, fw, bw):
    """HF Llama under `plan` with the env set while it is applied, eager and compiled whole (aot_eager):
    no graph break, the graphs' pynccl ops as fw / bw, values as the unwrapped and eager models'.
    Also tests/test_tp_async_allreduce.py's."""
    cfg = llama_config(use_cache=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    os.environ.update(env)
    try:
        eager = tp.parallelize_module(copy.deepcopy(ref), group, plan)
        compiled, seen = _compiled(tp.parallelize_module(copy.deepcopy(ref), group, plan), "record")
    finally:
        for key in env:
            os.environ.pop(key, None)
    x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    llama_compiled_equals_eager(ref, eager, compiled, seen, x, group, what, fw, bw)


def _compile_case(rank, world):
    # Forward: the embedding's all-reduce and the loss's two; the first layer's slice; per layer two
    # gathers with their projections and two reduce-scatters, the LM head's gather. Backward: their
    # backward ops, the slice's all-gather and the norm weights' grads summed.
    fw = {"all_reduce": 3, "tp_gather_linears": 2 * LAYERS + 1, "tp_linear_reduce_scatter": 2 * LAYERS}
    bw = {"all_reduce": 2 * LAYERS + 1, "all_gather_into_tensor": 1, "tp_gather_linears_backward": 2 * LAYERS + 1,
          "tp_linear_reduce_scatter_backward": 2 * LAYERS}
    compiled_llama_case(pynccl.get_default_group(), tp.plans.llama(sequence_parallel=True), {"PYNCCL_TP_ASYNC": "1"},
                        "llama sp, async TP, compiled", fw, bw)
    return True


@pytest.mark.numerics
def test_async_tp_compiles_without_graph_breaks():
    assert run_multiprocess(_compile_case, 2, timeout=600) == [True, True]


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_async_tp_ops_on_nccl(world):
    """On NCCL the ops run in C++ (csrc/tp_overlap.cpp): each output and gradient equals the Python
    reference's (the same GEMMs on the same chunks, the sums in the same order: bit for bit), the
    chunks moved through the group's symmetric window (copy engines) and by NCCL's kernels alike;
    then the plans as on gloo (at 2 ranks: the test models split their heads in 2)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    assert run_multiprocess(_gpu_case, world, backend="nccl", start_method="spawn", timeout=600) == [True] * world


def _gpu_case(rank, world):
    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 means fp32: the bounds are fp32's
    group = pynccl.get_default_group()
    device = pynccl.get_device(group)
    from pynccl.comm.symmetric import symmetric_support
    from pynccl.tensor_parallel import async_tp_allreduce as ar
    for mode in ("all_reduce", "gather"):
        os.environ[ar.SUM_ENV] = mode
        try:
            _native_matches_python(group, device)
        finally:
            os.environ.pop(ar.SUM_ENV, None)
    if symmetric_support(group).available:   # then the C++ side above ran on the window in one mode
        assert group._scratch_windows[async_tp._EXCHANGE_KEY][0] is not None, "no symmetric window for the chunks"
    if world != 2:
        return True
    for what, config, plan in (("llama", llama_config(use_cache=False), tp.plans.llama(sequence_parallel=True)),
                               ("gpt2", gpt2_config(use_cache=False), tp.plans.gpt2(sequence_parallel=True))):
        with _Counted() as seen:
            check_plan(config, plan, group, f"{what}, async TP on NCCL", device=device)
        assert seen.calls["gather_linears"] > 0 and seen.calls["linear_reduce_scatter"] > 0, dict(seen.calls)
    return True


def _native_matches_python(group, device):
    n = group.world_size
    for seq_dim, shape in ((1, (3, 4 * n, 64)), (0, (4 * n, 3, 64))):
        x = _seeded(shape[:seq_dim] + (shape[seq_dim] // n,) + shape[seq_dim + 1:], 40 + group.group_rank).to(device)
        ws = [_seeded((32, 64), 41).to(device), _seeded((16, 64), 42).to(device)]
        h = _seeded(shape[:-1] + (48,), 43 + group.group_rank).to(device)
        w2 = _seeded((64, 48), 44).to(device)
        runs = []
        for native in (True, False):
            original = async_tp.native
            if not native:
                async_tp.native = lambda g, name: None
            try:
                xr, wr = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
                full, ys = async_tp.gather_linears(xr, wr, group, seq_dim)
                (sum((y * (i + 1)).sum() for i, y in enumerate(ys)) + full.sum()).backward()
                hr, w2r = h.clone().requires_grad_(), w2.clone().requires_grad_()
                out = async_tp.linear_reduce_scatter(hr, w2r, group, seq_dim)
                (out * out).sum().backward()
                runs.append([full, *ys, xr.grad, *[w.grad for w in wr], out, hr.grad, w2r.grad])
            finally:
                async_tp.native = original
        for i, (a, b) in enumerate(zip(*runs)):
            assert torch.equal(a, b), f"seq_dim {seq_dim}: C++ and Python differ in result {i}"
