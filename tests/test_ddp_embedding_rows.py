"""Issue 26, DistributedDataParallel(tied_embedding_rows=True): a tied embedding's lookup gradient
exchanged as rows (pynccl/ddp/embedding_rows.py), against torch DDP on gloo in the same process.

Tolerances (tests/numerics.py): both sides compute the same per-rank head and lookup gradients;
only the order of the final sums differs. torch sums each rank's head part and lookup rows
(embedding backward), then the ranks (all-reduce), then scales by 1/N; here the ranks' head parts
are summed and scaled, then every rank's rows are added one by one. Each element is a sum of at
most 1 + (ranks · tokens) terms in either order: chain_rtol(ranks · tokens + ranks + 1) of the
tensor's largest gradient. A lost rank's rows, a missed 1/N, or rows added twice move an element
by a whole row's worth, ~1/(tokens) of the gradient's scale at least: far above that.
"""
import pytest

from pynccl.testing import run_multiprocess

# NOTE: VOCAB 80 >= ranks x tokens (2 x 24, 3 x 24): the rows path; longer sequences (2 x SEQ) take
# the dense fallback (embedding_rows.py: the gathered rows would outweigh the dense gradient).
VOCAB, DIM, BATCH, SEQ, STEPS = 80, 16, 3, 8, 4


def _model(padding_idx=None):
    import torch
    from torch import nn

    class TiedLM(nn.Module):
        """nanoGPT's shape in miniature: token + position embeddings, one block, the head tied to
        the token embedding (wte.weight is lm_head.weight, registered by both modules)."""

        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
            self.wpe = nn.Embedding(2 * SEQ, DIM)
            self.block = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, targets=None):
            pos = torch.arange(idx.shape[1], device=idx.device)
            h = self.wte(idx) + self.wpe(pos)
            h = h + self.block(h)
            logits = self.lm_head(h)
            if targets is None:
                return logits
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.manual_seed(0)
    return TiedLM()


def _hf_gpt2():
    """transformers' GPT2LMHeadModel, random init (lm_head.weight is transformer.wte.weight)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(cfg)


def _loss(model, idx, tgt, hf):
    return model(input_ids=idx, labels=tgt).loss if hf else model(idx, tgt)


def _batches(rank, seq=SEQ, padding_idx=None, n=STEPS):
    import torch
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        idx = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
        if padding_idx is not None:
            idx[:, -2:] = padding_idx                    # padded tails, as a packed batch has
        out.append((idx, torch.randint(0, VOCAB, (BATCH, seq), generator=g)))
    return out


def _grad_rtol(ws, tokens):
    from numerics import chain_rtol
    return chain_rtol(ws * tokens + ws + 1)


def _both(rank, ws, *, opt="plain-sgd", accumulate=1, seq_of=None, padding_idx=None, grad_as_view=False,
          check_grads=True, hf=False, exchange="rows"):
    """Trains pynccl DDP(tied_embedding_rows=True) and torch DDP side by side on the same batches;
    asserts the gradients after every backward and the parameters after every step."""
    import contextlib
    import torch
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within, record_grad_scale, trained_atol

    seq = seq_of(rank) if seq_of else SEQ
    build = _hf_gpt2 if hf else (lambda: _model(padding_idx))
    ours = pynccl.DistributedDataParallel(build(), tied_embedding_rows=True,
                                          gradient_as_bucket_view=grad_as_view, bucket_cap_mb=0.001)
    ref = torch.nn.parallel.DistributedDataParallel(build(), process_group=tdist.group.WORLD, bucket_cap_mb=0.001)
    tied = ours.module.transformer.wte.weight if hf else ours.module.wte.weight
    assert ours.reducer.tied_rows is not None and ours.reducer.tied_rows.embeddings[0].weight is tied
    make = {"plain-sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)}[opt]
    o_ours, o_ref = make(ours.parameters()), make(ref.parameters())
    grad_scale = {}
    tokens = max((seq_of(r) if seq_of else SEQ) for r in range(ws)) * BATCH
    rtol = _grad_rtol(ws, tokens)
    for step, (idx, tgt) in enumerate(_batches(rank, seq, padding_idx)):
        for model, o in ((ours, o_ours), (ref, o_ref)):
            o.zero_grad(set_to_none=not grad_as_view)
            for i, (mi, mt) in enumerate(zip(idx.chunk(accumulate), tgt.chunk(accumulate))):
                last = i == accumulate - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    (_loss(model, mi, mt, hf) / accumulate).backward()
        if check_grads:
            for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
                assert_within(p.grad, q.grad, rtol * q.grad.abs().max().item(), f"step {step} grad of {name}")
        assert ours.reducer.tied_rows.last_exchange == exchange
        record_grad_scale(ref.module.parameters(), grad_scale)
        o_ours.step()
        o_ref.step()
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p, q, trained_atol(o_ref, q, rtol, grad_scale.get(q), STEPS), f"trained {name}")
    # the replicas stay equal: every rank added the same rows in the same order
    w = tied.detach().clone()
    everyone = [torch.empty_like(w) for _ in range(ws)]
    tdist.all_gather(everyone, w)
    assert all(torch.equal(everyone[0], x) for x in everyone), "the tied weight differs across ranks"


def _run(fn, ws=2, **kw):
    run_multiprocess(fn, ws, backend="gloo", timeout=300, kwargs=kw)


@pytest.mark.numerics
@pytest.mark.parametrize("opt", ["plain-sgd", "adamw"])
def test_equals_torch_ddp(opt):
    _run(_both, opt=opt)


@pytest.mark.numerics
def test_hugging_face_gpt2_equals_torch_ddp():
    _run(_both, opt="adamw", hf=True)


def _from_environment(rank, ws, expect_on):
    """The default (None) is off (opt-in, pynccl/ddp/defaults.py says why);
    PYNCCL_DDP_TIED_EMBEDDING_ROWS=1 turns it on, =0 off, only for models that have a tied
    embedding (an untied one keeps the default, without an error). Bucket views are the default."""
    from torch import nn
    import pynccl
    default = pynccl.DistributedDataParallel(_hf_gpt2())
    assert (default.reducer.tied_rows is not None) == expect_on
    assert default.gradient_as_bucket_view is True and default.reducer.grad_as_view     # the default: views
    if expect_on:
        assert default.reducer.tied_rows.explicit is False
    untied = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4))
    assert pynccl.DistributedDataParallel(untied).reducer.tied_rows is None
    assert pynccl.DistributedDataParallel(_hf_gpt2(), tied_embedding_rows=False).reducer.tied_rows is None
    assert pynccl.DistributedDataParallel(_hf_gpt2(), tied_embedding_rows=True).reducer.tied_rows.explicit


@pytest.mark.parametrize("env,expect_on", [(None, False), ("1", True), ("0", False)])
def test_default_and_environment_variable(env, expect_on):
    run_multiprocess(_from_environment, 2, backend="gloo", timeout=300, kwargs=dict(expect_on=expect_on),
                     env={} if env is None else {"PYNCCL_DDP_TIED_EMBEDDING_ROWS": env})


def test_environment_values_and_bad_ones():
    from pynccl.ddp import defaults
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, {"PYNCCL_DDP_TIED_EMBEDDING_ROWS": "yes"}):
        with pytest.raises(ValueError, match="PYNCCL_DDP_TIED_EMBEDDING_ROWS must be 0 or 1, got 'yes'"):
            defaults.tied_embedding_rows(None, _model())
    with pytest.raises(TypeError, match="gradient_as_bucket_view must be a bool or None"):
        defaults.gradient_as_bucket_view(1)
    assert defaults.gradient_as_bucket_view(None) is True and defaults.gradient_as_bucket_view(False) is False
    with mock.patch.dict(os.environ, {"PYNCCL_DDP_GRADIENT_AS_BUCKET_VIEW": "0"}):
        assert defaults.gradient_as_bucket_view(None) is False and defaults.gradient_as_bucket_view(True) is True
    with mock.patch.dict(os.environ, {"PYNCCL_DDP_GRADIENT_AS_BUCKET_VIEW": "on"}):
        with pytest.raises(ValueError, match="PYNCCL_DDP_GRADIENT_AS_BUCKET_VIEW must be 0 or 1, got 'on'"):
            defaults.gradient_as_bucket_view(None)


@pytest.mark.numerics
@pytest.mark.parametrize("opt", ["plain-sgd", "adamw"])
def test_many_tokens_take_the_dense_fallback(opt):
    """2 ranks x 48 tokens > VOCAB: the gathered rows would outweigh the dense gradient, so the
    lookup's dense gradient is all-reduced at the end instead; still equal to torch DDP."""
    _run(_both, opt=opt, seq_of=lambda r: 2 * SEQ, exchange="dense")


def _steps_aside(rank, ws, what):
    """Chosen by default (here through the variable), the rows path turns itself off where a
    feature needs the plain path, instead of refusing; the model then trains as torch DDP."""
    import torch
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within
    ours = pynccl.DistributedDataParallel(_model())
    ref = torch.nn.parallel.DistributedDataParallel(_model(), process_group=tdist.group.WORLD)
    assert ours.reducer.tied_rows is not None and not ours.reducer.tied_rows.explicit
    idx, tgt = _batches(rank)[0]
    ours(idx, tgt).backward()                           # one step on the rows path first
    ref(idx, tgt).backward()
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
    if what == "join":
        with ours.join(), ref.join():
            for m in (ours, ref):
                m(idx, tgt).backward()
    else:
        if what == "overlap_optimizer":
            ours.overlap_optimizer(torch.optim.SGD(ours.parameters(), lr=0.0))
        elif what == "comm_hook":
            def hook(state, bucket):                    # torch's allreduce hook, written out
                fut = tdist.all_reduce(bucket.buffer().div_(ws), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])
            ours.register_comm_hook(None, hook)
        elif what == "weight_hook":
            ours.module.wte.weight.register_hook(lambda g: g)
            ref.module.wte.weight.register_hook(lambda g: g)
        from unittest import mock
        with mock.patch("pynccl.ddp.embedding_rows._capturing", return_value=what == "cuda_graph_capture"):
            for m in (ours, ref):
                m(idx, tgt).backward()
    assert ours.reducer.tied_rows is None
    assert type(ours.module.wte).forward is torch.nn.Embedding.forward and "forward" not in vars(ours.module.wte)
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), f"{what}: {name}")


@pytest.mark.parametrize("what", ["join", "overlap_optimizer", "comm_hook", "weight_hook", "cuda_graph_capture"])
def test_the_default_steps_aside_for_features_that_need_the_plain_path(what):
    run_multiprocess(_steps_aside, 2, backend="gloo", timeout=300, kwargs=dict(what=what),
                     env={"PYNCCL_DDP_TIED_EMBEDDING_ROWS": "1"})


@pytest.mark.numerics
def test_three_ranks_uneven_token_counts():
    """Rank r feeds SEQ - r tokens per sequence: every rank's rows are padded to the largest count."""
    _run(_both, ws=3, seq_of=lambda r: SEQ - r)


@pytest.mark.numerics
def test_no_sync_accumulation_padding_idx_and_bucket_views():
    """Micro-batches accumulated in no_sync() (plain lookups there: dense, local), the padding row
    (no lookup gradient, the head's part only) and gradient_as_bucket_view=True."""
    _run(_both, accumulate=2, padding_idx=0, grad_as_view=True)


def _order_of_events(rank, ws, rows):
    """When the tied weight's bucket is handed to the all-reduce, relative to the point where
    backward reaches the token embedding (its output's gradient is complete)."""
    import pynccl
    events = []
    model = pynccl.DistributedDataParallel(_model(), tied_embedding_rows=rows, bucket_cap_mb=0.001)
    tied = model.module.wte.weight
    bucketer = model.reducer.bucketer
    real_ready = bucketer.on_bucket_ready

    def on_ready(b):
        if any(p is tied for p in b.params):
            events.append("tied bucket")
        return real_ready(b)
    bucketer.on_bucket_ready = on_ready

    def on_lookup(module, inputs, out):
        out.register_hook(lambda g: events.append("lookup backward"))
    model.module.wte.register_forward_hook(on_lookup)
    idx, tgt = _batches(rank)[0]
    for _ in range(2):                                  # the second after the bucket rebuild
        events.clear()
        model(idx, tgt).backward()
    expected = ["tied bucket", "lookup backward"] if rows else ["lookup backward", "tied bucket"]
    assert events == expected, events


@pytest.mark.parametrize("rows", [True, False])
def test_tied_bucket_reduces_before_backward_reaches_the_embedding(rows):
    """The point of the path: the tied weight's bucket goes out once the head's part is in, before
    backward reaches the embedding; by default it waits for the lookup (the last op of backward)."""
    _run(_order_of_events, rows=rows)


def _refusals(rank, ws):
    import torch
    from torch import nn
    import pynccl
    from pynccl import comm_hooks

    with pytest.raises(ValueError, match="no nn.Embedding whose weight another module"):
        pynccl.DistributedDataParallel(nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4)), tied_embedding_rows=True)
    model = pynccl.DistributedDataParallel(_model(), tied_embedding_rows=True)
    with pytest.raises(RuntimeError, match="overlap_optimizer: not supported with tied_embedding_rows"):
        model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="join: not supported with tied_embedding_rows"):
        model.join()
    with pytest.raises(ValueError, match="only pynccl's built-in hooks"):
        model.register_comm_hook(None, lambda state, bucket: None)
    model.register_comm_hook(None, comm_hooks.bf16_compress_hook)      # a built-in hook over the DDP group


def test_refusals_name_what_is_supported():
    _run(_refusals)


def _forward_without_backward(rank, ws):
    """A synced forward whose output never reaches a loss (an evaluation with grad on) before the
    training step: its lookup goes with the next backward's exchange as zeros, on every rank."""
    import torch
    import torch.distributed as tdist
    import pynccl
    ours = pynccl.DistributedDataParallel(_model(), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(_model(), process_group=tdist.group.WORLD)
    (idx, tgt), (idx2, tgt2) = _batches(rank, n=2)
    for m in (ours, ref):
        m(idx2, tgt2)                                   # discarded
        m(idx, tgt).backward()
    from numerics import assert_within
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), name)


def test_forward_without_backward_first():
    _run(_forward_without_backward)


def _zero_tokens_on_one_rank(rank, ws):
    """Rank 1 feeds an empty batch (a data loader's last, uneven step): it exchanges no rows of its
    own, receives rank 0's, and both equal torch DDP (loss: the sum of squared logits, defined
    for an empty batch)."""
    import torch
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within
    ours = pynccl.DistributedDataParallel(_model(), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(_model(), process_group=tdist.group.WORLD)
    idx, _ = _batches(0)[0]
    idx = idx if rank == 0 else idx[:0]
    for m in (ours, ref):
        m(idx).square().sum().backward()
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), name)


def test_a_rank_with_no_tokens():
    _run(_zero_tokens_on_one_rank)


def _uses_outside_ddp_backward(rank, ws):
    """Where the rows path would give wrong gradients, it steps aside or raises, naming the cause."""
    import copy
    import torch
    import torch.distributed as tdist
    from torch import nn
    import pynccl
    from numerics import assert_within
    idx, tgt = _batches(rank)[0]
    ours = pynccl.DistributedDataParallel(_model(), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(_model(), process_group=tdist.group.WORLD)
    tol = _grad_rtol(ws, BATCH * SEQ)

    # A deep copy (an EMA model) looks up its own weight, as torch does, and records nothing.
    ema = copy.deepcopy(ours.module)
    with torch.no_grad():
        ema.wte.weight.zero_()
    assert ema.wte(idx).abs().max().item() == 0.0
    assert ours.reducer.tied_rows.lookups == []

    # A direct call of the wrapped module (not through DDP) looks up as torch does: nothing recorded,
    # and the next DDP step still equals torch DDP's.
    ours.module(idx, tgt).backward()
    ref.module(idx, tgt).backward()
    assert ours.reducer.tied_rows.lookups == []
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
        m(idx, tgt).backward()
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p.grad, q.grad, tol * q.grad.abs().max().item(), name)

    # torch.autograd.grad of the tied weight gets the head's part only (documented); the lookup it
    # never ran goes with the next backward's exchange as zeros, and that step equals torch DDP's.
    torch.autograd.grad(ours(idx, tgt), [ours.module.wte.weight])
    torch.autograd.grad(ref(idx, tgt), [ref.module.wte.weight])
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
        m(idx, tgt).backward()
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p.grad, q.grad, tol * q.grad.abs().max().item(), f"after autograd.grad: {name}")

    # A second backward through the same lookup (retain_graph) would lose its rows.
    loss = ours(idx, tgt)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the same embedding lookup"):
        loss.backward()

    # Token ids refilled in place before the end of backward.
    ids = idx.clone()
    loss = ours(ids, tgt)
    ids.fill_(1)
    with pytest.raises(RuntimeError, match="modified in place before the end of backward"):
        loss.backward()

    # A hook on the tied weight would see the head's part only.
    handle = ours.module.wte.weight.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match="the tied weight has a gradient hook"):
        ours(idx, tgt)
    handle.remove()

    # A forward captured in a CUDA graph (the exchange reads counts on the host): refused when asked
    # for outright (the default steps aside: test_the_default_steps_aside_...).
    from unittest import mock
    with mock.patch("pynccl.ddp.embedding_rows._capturing", return_value=True):
        with pytest.raises(RuntimeError, match="a CUDA graph is being captured"):
            ours(idx, tgt)

    # An embedding subclass with a forward of its own (HF Gemma scales its lookup) is left alone.
    class Scaled(nn.Embedding):
        def forward(self, input):
            return super().forward(input) * 8.0
    scaled = nn.Sequential(Scaled(6, 4), nn.Linear(4, 6, bias=False))
    scaled[1].weight = scaled[0].weight
    from pynccl.ddp.embedding_rows import tied_embeddings as found
    plain = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    plain[1].weight = plain[0].weight
    assert found(scaled) == [] and found(plain) == [plain[0]]

    # A parametrized embedding (its weight computed) is left alone, also when the variable asks.
    untied = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 4))
    nn.utils.parametrizations.weight_norm(untied[0])
    from pynccl.ddp.embedding_rows import tied_embeddings
    assert tied_embeddings(untied) == []


def test_uses_outside_ddp_backward_step_aside_or_raise():
    _run(_uses_outside_ddp_backward)


def _saved_and_copied(rank, ws):
    """torch.save of the whole module (not only its state_dict) and copy.deepcopy work with the rows
    path installed; what comes back looks up as torch does, and the original stays on the path."""
    import copy
    import io
    import torch
    import pynccl
    import functools
    ours = pynccl.DistributedDataParallel(_hf_gpt2(), tied_embedding_rows=True)
    rows = ours.reducer.tied_rows
    idx, tgt = _batches(rank)[0]
    assert "forward" not in vars(ours.module.transformer.wte)      # installed only inside DDP's forward
    copies = []
    for inside in (False, True):                                   # saved and copied outside and inside it
        with rows.forward_window(inside):
            assert ("forward" in vars(ours.module.transformer.wte)) == inside
            with torch.no_grad():                                  # torch's parameter name works too
                assert torch.equal(ours.module.transformer.wte(input=idx), ours.module.transformer.wte(idx))
            buf = io.BytesIO()
            torch.save(ours.module, buf)
            buf.seek(0)
            copies += [(inside, torch.load(buf, weights_only=False)), (inside, copy.deepcopy(ours.module))]
    assert "forward" not in vars(ours.module.transformer.wte)
    for inside, other in copies:
        wte = other.transformer.wte
        if inside:                     # torch's own forward bound to the copy: loads without pynccl
            assert isinstance(vars(wte)["forward"], functools.partial) and wte.forward.args == (wte,)
        else:
            assert "forward" not in vars(wte)
        assert torch.equal(wte(idx), torch.nn.functional.embedding(idx, wte.weight))
        other(input_ids=idx, labels=tgt).loss.backward()           # trains as a plain model
        assert other.transformer.wte.weight.grad is not None
    assert ours.reducer.tied_rows.lookups == []
    ours(input_ids=idx, labels=tgt).loss.backward()
    assert ours.reducer.tied_rows.last_exchange == "rows"


def test_whole_module_saved_and_deep_copied():
    _run(_saved_and_copied)


def _compiled_inside(rank, ws):
    """nanoGPT's order: torch.compile(model), then DDP. The lookup is inside dynamo's graph, which
    traces torch's lookup (no rows recorded), and the result equals torch DDP over the same
    compiled model."""
    import torch
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within
    torch._dynamo.reset()
    ours = pynccl.DistributedDataParallel(torch.compile(_model(), backend="eager"), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(torch.compile(_model(), backend="eager"),
                                                    process_group=tdist.group.WORLD)
    for step, (idx, tgt) in enumerate(_batches(rank, n=3)):
        # NOTE: after the first step nothing may recompile (each DDP forward installs the same forward object)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            for m in (ours, ref):
                m.zero_grad(set_to_none=True)
                m(idx, tgt).backward()
        assert ours.reducer.tied_rows.last_exchange is None
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), name)


def test_compiled_model_inside_looks_up_as_torch():
    _run(_compiled_inside)


def _checkpointed_lookup(rank, ws):
    """Non-reentrant activation checkpointing around the embedding (torch's recommended mode): the
    recompute runs in backward, outside DDP's forward, so the lookup takes torch's path in the
    forward too (else the recomputed tensors differ: CheckpointError); equal to torch DDP."""
    import torch
    import torch.distributed as tdist
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    import pynccl
    from numerics import assert_within

    def build():
        model = _model()

        def trunk(idx):
            h = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
            return h + model.block(h)

        def forward(idx, targets):
            h = checkpoint(trunk, idx, use_reentrant=False)
            return nn.functional.cross_entropy(model.lm_head(h).flatten(0, 1), targets.flatten())
        model.forward = forward
        return model
    ours = pynccl.DistributedDataParallel(build(), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(build(), process_group=tdist.group.WORLD)
    for idx, tgt in _batches(rank, n=2):
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
            m(idx, tgt).backward()
        assert ours.reducer.tied_rows.last_exchange is None and ours.reducer.tied_rows.lookups == []
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), name)


def test_checkpointed_lookup_takes_torchs_path():
    _run(_checkpointed_lookup)
