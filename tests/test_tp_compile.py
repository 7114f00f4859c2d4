"""pynccl tensor parallelism under torch.compile (gloo, 2 ranks, backend aot_eager): the collectives
are custom ops (pynccl/comm/functional_collectives.py), so dynamo captures the whole TP model as
one graph with no break, and AOTAutograd's forward AND backward graphs hold the collectives (no
compiled autograd involved). Checked on a Hugging Face Llama parallelized by plan (with and without
sequence parallelism, vocabulary-parallel loss) and on the Megatron-layout GPT block, compiled
whole: no graph break, one graph, the expected collectives in each of the forward and backward
graphs; the compiled loss, output and every gradient equal eager pynccl TP's and the unwrapped
single-process model's (the matching shard of it) within the fp32 rounding of the model's
reductions (tests/numerics.py). torch.library.opcheck holds each op's fake against the real op.
On 2 GPUs the same checks run on NCCL under inductor.
"""
import collections
import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork, once)

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.comm import functional_collectives as fc
from pynccl.testing import run_multiprocess
from pynccl.testing.reference_models import TransformerBlock
from numerics import assert_within, chain_rtol, transformer_rtol

transformers = pytest.importorskip("transformers")

LAYERS, BATCH, SEQ, VOCAB = 2, 2, 8, 128
LLAMA_TOL = transformer_rtol(LAYERS, 64, 128, 16, SEQ, VOCAB, BATCH * SEQ)
S, B, H, HEADS, FFN = 8, 2, 24, 4, 48
# The block's chain (as tests/test_tensor_parallel.py): norms, qkv, proj (H each), the scores (head
# dim), softmax and P·V (S), fc (H), proj (FFN), forward and backward, and the sums over S × B.
BLOCK_TOL = chain_rtol(2 * (5 * H + H // HEADS + 2 * S + FFN), 2 * S * B)
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _graph_recorder():
    """aot_eager that records, per graph AOTAutograd hands it, how many of each pynccl op it holds."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    seen = {"forward": [], "backward": []}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            ops = collections.Counter(n.target.name().split("::")[1].split(".")[0] for n in gm.graph.nodes
                                      if n.op == "call_function" and hasattr(n.target, "name")
                                      and n.target.name().startswith("pynccl::"))
            seen[kind].append(ops)
            return make_boxed_func(gm.forward)
        return compile_graph
    return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward")), seen


def _compiled(model, backend):
    """The model compiled whole, from a reset dynamo; returns it and the graphs' op counts
    (backend "record": aot_eager recording them; else None)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    seen = None
    if backend == "record":
        backend, seen = _graph_recorder()
    return torch.compile(model, backend=backend), seen


def _no_breaks(seen, what, fw_ops, bw_ops):
    from torch._dynamo.utils import counters
    assert not counters["graph_break"], f"{what}: graph breaks {dict(counters['graph_break'])}"
    assert counters["stats"]["unique_graphs"] == 1, f"{what}: {counters['stats']['unique_graphs']} graphs"
    if seen is None:
        return
    assert len(seen["forward"]) == 1 and len(seen["backward"]) == 1, f"{what}: {seen}"
    assert seen["forward"][0] == fw_ops, f"{what}: forward graph ops {seen['forward'][0]} != {fw_ops}"
    assert seen["backward"][0] == bw_ops, f"{what}: backward graph ops {seen['backward'][0]} != {bw_ops}"


def _close(actual, expected, what, tol):
    """|actual - expected| <= tol × max |expected|, element-wise."""
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_within(actual, expected.to(actual.dtype), tol * expected.detach().abs().max().item(), what)


def _grads_close(compiled, eager, ref, group, what, tol):
    """Every grad of the compiled model against eager TP's and the unwrapped model's shard of it."""
    ref_params = dict(ref.named_parameters())
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        name = name.removeprefix("_orig_mod.")
        _close(p.grad, tp.shard_like(q, ref_params[name].grad, group), f"{what}: grad of {name} vs unwrapped", tol)
        _close(p.grad, q.grad, f"{what}: grad of {name} vs eager TP", tol)


def _llama_case(group, sequence_parallel, device="cpu", backend="record"):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(device)
    plan = tp.plans.llama(sequence_parallel=sequence_parallel)
    eager = tp.parallelize_module(copy.deepcopy(ref), group, plan)
    compiled, seen = _compiled(tp.parallelize_module(copy.deepcopy(ref), group, plan), backend)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    # Forward: the embedding's all-reduce, the loss's two (max, then the sums); per layer the
    # attention and MLP outputs' all-reduce (sp: reduce-scatter, and their inputs' all-gathers),
    # sp the LM head's input gathered. Backward the conjugates: without sp, each attention / MLP
    # input's gradient sum and the LM head input's, each beside its readers' weight GEMMs in one op
    # (the default overlap, async_tp_allreduce.py); with sp, each all-gather's reduce-scatter and
    # each reduce-scatter's all-gather, the first layer's input slice's all-gather, the LM head's
    # input gathered again (it saves only its shard), and the norm weights' grads summed.
    if sequence_parallel:
        fw = {"all_reduce": 3, "all_gather_into_tensor": 2 * LAYERS + 1, "reduce_scatter_tensor": 2 * LAYERS}
        bw = {"all_reduce": 2 * LAYERS + 1, "all_gather_into_tensor": 2 * LAYERS + 2,
              "reduce_scatter_tensor": 2 * LAYERS + 1}
    else:
        fw, bw = {"all_reduce": 2 * LAYERS + 3}, {"tp_linears_all_reduce_backward": 2 * LAYERS + 1}
    llama_compiled_equals_eager(ref, eager, compiled, seen, x, group, f"llama sp={sequence_parallel}", fw, bw)


def llama_compiled_equals_eager(ref, eager, compiled, seen, x, group, what, fw, bw):
    """Train step on each of the unwrapped, eager-TP and compiled-TP Llama; then no graph break, the
    graphs' pynccl ops as fw / bw, and loss, logits and every grad within LLAMA_TOL."""
    ref_out = ref(input_ids=x, labels=x)
    ref_out.loss.backward()
    eager_out = eager(input_ids=x, labels=x)
    eager_out.loss.backward()
    out = compiled(input_ids=x, labels=x)
    out.loss.backward()
    _no_breaks(seen, what, collections.Counter(fw), collections.Counter(bw))
    _close(out.loss, ref_out.loss.detach(), f"{what}: loss vs unwrapped", LLAMA_TOL)
    _close(out.loss, eager_out.loss.detach(), f"{what}: loss vs eager TP", LLAMA_TOL)
    _close(out.logits, eager_out.logits.detach(), f"{what}: logits vs eager TP", LLAMA_TOL)
    _grads_close(compiled, eager, ref, group, what, LLAMA_TOL)


def _block_case(group, sequence_parallel, device="cpu", backend="record"):
    torch.manual_seed(0)
    ref = TransformerBlock(H, HEADS, FFN, device=device)
    eager = tp.ParallelTransformerBlock.from_module(ref, group, sequence_parallel)
    compiled, seen = _compiled(tp.ParallelTransformerBlock.from_module(ref, group, sequence_parallel), backend)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).to(device)
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2)).to(device)

    def local(t):
        return t.chunk(group.world_size, 0)[group.group_rank] if sequence_parallel else t

    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    results = []
    for model in (eager, compiled):
        x_par = local(x).clone().requires_grad_()
        y = model(x_par)
        y.backward(local(dy))
        results.append((y.detach(), x_par.grad))
    what = f"block sp={sequence_parallel}"
    # The attention and MLP enter (f / all-gather) and leave (g / reduce-scatter) a TP region once
    # each; sp also sums the grads of the replicated parameters used on the sequence shard (one
    # all-reduce each for the two norms and the two row-parallel biases). Backward, each column-
    # parallel input's all-gather runs again (only the shard is saved for backward).
    if sequence_parallel:
        fw = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
        bw = {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 2, "all_reduce": 4}
    else:
        fw, bw = {"all_reduce": 2}, {"all_reduce": 2}
    _no_breaks(seen, what, collections.Counter(fw), collections.Counter(bw))
    (y_eager, dx_eager), (y, dx) = results
    _close(y, local(y_ref.detach()), f"{what}: output vs unwrapped", BLOCK_TOL)
    _close(y, y_eager, f"{what}: output vs eager TP", BLOCK_TOL)
    _close(dx, local(x_ref.grad), f"{what}: input grad vs unwrapped", BLOCK_TOL)
    _close(dx, dx_eager, f"{what}: input grad vs eager TP", BLOCK_TOL)
    _grads_close(compiled, eager, ref, group, what, BLOCK_TOL)


def _opcheck_case(group):
    """Each op's fake (shape, dtype, strides) and schema against the real op; every rank runs the
    same sequence, so the collectives inside opcheck's runs match up."""
    name, n = fc.group_name(group), group.world_size
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(group.group_rank))
    for op, args in ((torch.ops.pynccl.all_reduce.default, (x, "sum", name)),
                     (torch.ops.pynccl.all_gather_into_tensor.default, (x, n, name)),
                     (torch.ops.pynccl.reduce_scatter_tensor.default, (x, "sum", n, name))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    gathered = torch.ops.pynccl.all_gather_into_tensor(x, n, name)
    before = x.clone()
    summed = torch.ops.pynccl.all_reduce(x, "sum", name)
    assert torch.equal(summed, gathered.view(n, 4, 3).sum(0)), "all_reduce != the sum of the gathered inputs"
    # out of place: the input is left alone (contiguous, where nothing copies it first), and a
    # non-contiguous one is read as its values
    assert torch.equal(x, before) and summed.data_ptr() != x.data_ptr()
    summed_t = torch.ops.pynccl.all_reduce(x.t(), "sum", name)
    assert torch.equal(x, before)
    assert summed_t.is_contiguous() and torch.equal(summed_t, gathered.view(n, 4, 3).sum(0).t())
    assert torch.equal(torch.ops.pynccl.reduce_scatter_tensor(gathered, "sum", n, name),
                       gathered.chunk(n)[group.group_rank] * n), "reduce_scatter of the same input on every rank"
    assert torch.equal(torch.ops.pynccl.all_reduce(x, "max", name), gathered.view(n, 4, 3).amax(0))
    with pytest.raises(ValueError, match="has 2 ranks, the op was traced for 3"):
        torch.ops.pynccl.all_gather_into_tensor(x, 3, name)
    with pytest.raises(ValueError, match="no live process group named 'nope'"):
        torch.ops.pynccl.all_reduce(x, "sum", "nope")


def _case(rank, world, device="cpu", backend="record", models=("block", "llama")):
    group = pynccl.get_default_group()
    if backend == "record":
        _opcheck_case(group)
    if device != "cpu":
        device = pynccl.get_device(group)
        torch.backends.cuda.matmul.allow_tf32 = False   # fp32 means fp32: the bounds are fp32's
        torch.backends.cudnn.allow_tf32 = False
    for sp in (False, True):
        if "block" in models:
            _block_case(group, sp, device, backend)
        if "llama" in models:
            _llama_case(group, sp, device, backend)
    return True


@pytest.mark.numerics
def test_tp_compiles_without_graph_breaks():
    assert run_multiprocess(_case, 2, timeout=900) == [True, True]


@pytest.mark.numerics
def test_tp_block_compiles_with_inductor_on_cpu(tmp_path):
    """inductor's C++ code around the ops (extern calls, its buffer reuse around them) on the
    Megatron block, with and without sequence parallelism (~1 min: inductor compiles C++).

    NOTE: in a fresh inductor cache. torch 2.14's cache hands kernels generated for one
    ATEN_CPU_CAPABILITY (16-wide AVX-512 loops) to a run under another (avx2, 8-wide vectors):
    the gradients came out as garbage in one vector's lanes."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert run_multiprocess(_case, 2, timeout=900, env=env, kwargs=dict(backend="inductor", models=("block",))) \
        == [True] * 2


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp_compiles_with_inductor_on_nccl():
    """The same models on NCCL, CUDA tensors, compiled by inductor (the custom ops become extern
    calls in its code): no graph break, one graph, the same fp32 bounds against eager TP and the
    unwrapped model."""
    assert run_multiprocess(_case, 2, backend="nccl", start_method="spawn", timeout=900,
                            kwargs=dict(device="cuda", backend="inductor")) == [True, True]
