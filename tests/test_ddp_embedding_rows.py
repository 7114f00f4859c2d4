"""Issue 26, DistributedDataParallel's tied_embedding_rows (on by default where a model has an LM
head tied to an embedding): the head's part of the tied gradient all-reduced first, the rest
exchanged as rows (pynccl/ddp/embedding_rows.py), against torch DDP on gloo in the same process.

Tolerances (tests/numerics.py): both sides compute the same per-rank head and lookup gradients;
only the order of the final sums differs. torch sums each rank's head part and lookup rows
(autograd), then the ranks (all-reduce), then scales by 1/N; here the ranks' head parts are
summed and scaled, then every rank's rows are added one by one. Each element is a sum of at most
1 + (ranks · tokens) terms in either order: chain_rtol(ranks · tokens + ranks + 1) of the
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


def _batches(rank, seq=SEQ, padding_idx=None, n=STEPS, token_zero=False):
    import torch
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        idx = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
        if token_zero:
            idx[0, 0] = 0                                # row 0 is also the exchange's padding id
        if padding_idx is not None:
            idx[:, -2:] = padding_idx                    # padded tails, as a packed batch has
        out.append((idx, torch.randint(0, VOCAB, (BATCH, seq), generator=g)))
    return out


def _grad_rtol(ws, tokens):
    from numerics import chain_rtol
    return chain_rtol(ws * tokens + ws + 1)


def _both(rank, ws, *, opt="plain-sgd", accumulate=1, seq_of=None, padding_idx=None, grad_as_view=False,
          check_grads=True, hf=False, exchange="rows", set_to_none=None, token_zero=False, find_unused=False):
    """Trains pynccl DDP(tied_embedding_rows=True) and torch DDP side by side on the same batches;
    asserts the gradients after every backward and the parameters after every step."""
    import contextlib
    import torch
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within, record_grad_scale, trained_atol

    seq = seq_of(rank) if seq_of else SEQ
    build = _hf_gpt2 if hf else (lambda: _model(padding_idx))
    ours = pynccl.DistributedDataParallel(build(), tied_embedding_rows=True, find_unused_parameters=find_unused,
                                          gradient_as_bucket_view=grad_as_view, bucket_cap_mb=0.001)
    ref = torch.nn.parallel.DistributedDataParallel(build(), process_group=tdist.group.WORLD, bucket_cap_mb=0.001,
                                                    find_unused_parameters=find_unused)
    tied = ours.module.transformer.wte.weight if hf else ours.module.wte.weight
    assert ours.reducer.tied_rows is not None and ours.reducer.tied_rows.heads[0].weight is tied
    make = {"plain-sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)}[opt]
    o_ours, o_ref = make(ours.parameters()), make(ref.parameters())
    grad_scale = {}
    tokens = max((seq_of(r) if seq_of else SEQ) for r in range(ws)) * BATCH
    rtol = _grad_rtol(ws, tokens)
    for step, (idx, tgt) in enumerate(_batches(rank, seq, padding_idx, token_zero=token_zero)):
        for model, o in ((ours, o_ours), (ref, o_ref)):
            o.zero_grad(set_to_none=(not grad_as_view) if set_to_none is None else set_to_none)
            for i, (mi, mt) in enumerate(zip(idx.chunk(accumulate), tgt.chunk(accumulate))):
                last = i == accumulate - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    (_loss(model, mi, mt, hf) / accumulate).backward()
        if check_grads:
            for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
                assert_within(p.grad, q.grad, rtol * q.grad.abs().max().item(), f"step {step} grad of {name}")
        assert ours.reducer.tied_rows.last_exchange == exchange
        if tied.grad is not None:     # bit for bit on every rank: the rows are added in one order everywhere
            grads = [torch.empty_like(tied.grad) for _ in range(ws)]
            tdist.all_gather(grads, tied.grad.detach().contiguous())
            assert all(torch.equal(grads[0], g) for g in grads), f"step {step}: the tied gradient differs across ranks"
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


def _twice_seq(rank):
    return 2 * SEQ


def _seq_less_rank(rank):
    return SEQ - rank


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
    """The default (None) is on (pynccl/ddp/defaults.py); PYNCCL_DDP_TIED_EMBEDDING_ROWS=0 turns it
    off, =1 on, only for models that have a tied head (an untied one keeps the plain path, without
    an error). Bucket views are the default."""
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


@pytest.mark.parametrize("env,expect_on", [(None, True), ("1", True), ("0", False)])
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
    """3 ranks x ~36 distinct tokens of 48 > VOCAB: the gathered rows would outweigh the dense
    gradient, so the rest is all-reduced densely at the end instead; still equal to torch DDP."""
    _run(_both, ws=3, opt=opt, seq_of=_twice_seq, exchange="dense")


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
        sentinel = torch.zeros(1)
        if what == "cuda_graph_capture":     # as the rows window an earlier exchange made on CUDA
            ours.reducer.tied_rows._windows[0] = sentinel
        from unittest import mock
        with mock.patch("pynccl.ddp.embedding_rows._capturing", return_value=what == "cuda_graph_capture"):
            for m in (ours, ref):
                m(idx, tgt).backward()
    assert ours.reducer.tied_rows is None
    assert "forward" not in vars(ours.module.lm_head)
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), f"{what}: {name}")
    if what == "cuda_graph_capture":
        # The window outlives the capture that turned the path off (ncclMemFree inside a capture
        # invalidates it: session 14 on 2xH100); the reducer's next forward outside one frees it.
        assert any(w is sentinel for w in ours.reducer.retired_windows)
        ours(idx, tgt)
        assert not ours.reducer.retired_windows


@pytest.mark.parametrize("what", ["join", "overlap_optimizer", "comm_hook", "weight_hook", "cuda_graph_capture"])
def test_the_default_steps_aside_for_features_that_need_the_plain_path(what):
    run_multiprocess(_steps_aside, 2, backend="gloo", timeout=300, kwargs=dict(what=what),
                     env={"PYNCCL_DDP_TIED_EMBEDDING_ROWS": "1"})


@pytest.mark.numerics
def test_three_ranks_uneven_token_counts():
    """Rank r feeds SEQ - r tokens per sequence: every rank's rows are padded to the largest count
    (with id 0 and zero rows; token 0 is looked up, so a padding row with values would show)."""
    _run(_both, ws=3, seq_of=_seq_less_rank, token_zero=True)


@pytest.mark.numerics
def test_no_sync_accumulation_padding_idx_and_bucket_views():
    """Micro-batches accumulated in no_sync() (torch's path there: dense, local; it goes with the
    head's part), the padding row (no lookup gradient) and gradient_as_bucket_view=True, zeroed in
    place (.grad is the bucket's view; the rest accumulates apart)."""
    _run(_both, accumulate=2, padding_idx=0, grad_as_view=True)


@pytest.mark.numerics
@pytest.mark.parametrize("grad_as_view,set_to_none", [(False, False), (True, True)])
def test_gradient_copies_kept_and_views_set_to_none(grad_as_view, set_to_none):
    """The other two ways .grad meets a step: torch's copies zeroed in place (the diverted part
    is added into .grad's own tensor) and bucket views set to None (nanoGPT's zero_grad)."""
    _run(_both, grad_as_view=grad_as_view, set_to_none=set_to_none, accumulate=2)


@pytest.mark.numerics
def test_find_unused_parameters():
    """HF Trainer's default for DDP: find_unused_parameters=True; the path stays on."""
    _run(_both, find_unused=True, opt="adamw", hf=True)


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

    with pytest.raises(ValueError, match=r"no nn.Linear \(the LM head\) whose weight only nn.Embedding modules"):
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
    training step: its alias is dropped with its graph; the step equals torch DDP's."""
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


def _torch_semantics(rank, ws):
    """Where the gradient is needed outside DDP's reduction, the tied weight behaves as torch DDP's:
    autograd.grad, backward(inputs=...) with and without the weight, a loss that skips the head on
    one rank or on all, a deep copy, a direct call of ddp.module; what would change a hook's view
    of the gradient raises when asked for outright, naming the cause."""
    import copy
    import torch
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within
    idx, tgt = _batches(rank)[0]
    ours = pynccl.DistributedDataParallel(_model(), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(_model(), process_group=tdist.group.WORLD)
    rows = ours.reducer.tied_rows
    tol = _grad_rtol(ws, BATCH * SEQ)

    def same_grads(what, require_all=True):
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{what}: {name} has a grad on one side only"
            if q.grad is not None:
                assert_within(p.grad, q.grad, tol * q.grad.abs().max().item(), f"{what}: {name}")

    def step(what, loss_of, all_inputs=False):
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
            loss_of(m).backward(inputs=list(m.module.parameters()) if all_inputs else None)
        same_grads(what)

    # A deep copy (an EMA model) runs torch's linear and records nothing.
    ema = copy.deepcopy(ours.module)
    assert "forward" not in vars(ema.lm_head) and rows.steps == [None]

    # A direct call of the wrapped module (not through DDP): torch's path, no reduction, as torch's.
    step("direct call", lambda m: m.module(idx, tgt))
    assert rows.steps == [None]
    step("a DDP step", lambda m: m(idx, tgt))
    assert rows.last_exchange == "rows"
    step("int32 token ids", lambda m: m(idx.int(), tgt))
    assert rows.last_exchange == "rows"

    # torch.autograd.grad: the local gradient, head and lookup parts, as torch's (nothing reduced).
    g_ours, = torch.autograd.grad(ours(idx, tgt), [ours.module.wte.weight])
    g_ref, = torch.autograd.grad(ref(idx, tgt), [ref.module.wte.weight])
    assert_within(g_ours, g_ref, tol * g_ref.abs().max().item(), "autograd.grad of the tied weight")

    # backward(inputs=...) with every parameter (without the tied weight: last, below).
    step("backward(inputs=all)", lambda m: m(idx, tgt), all_inputs=True)

    # A loss that skips the head (its output unused) on rank 1 only, then on every rank: the weight
    # still gets the lookup's part, which torch DDP reduces.
    def hidden_on(ranks):
        def loss_of(m):
            seen = []
            handle = m.module.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
            logits = m(idx)
            handle.remove()
            if rank in ranks:                 # the head's input: every parameter but the head's use of wte
                return seen[0].square().mean()
            return logits.square().mean()
        return loss_of
    step("head skipped on rank 1", hidden_on({1}))
    step("head skipped everywhere", hidden_on(set(range(ws))))
    step("a DDP step after", lambda m: m(idx, tgt))

    # Hooks that would see the rest only: refused when asked for outright (the default steps aside:
    # test_the_default_steps_aside_...), and so is a CUDA graph capture (counts read on the host).
    handle = ours.module.wte.weight.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match="the tied weight has a gradient hook"):
        ours(idx, tgt)
    handle.remove()
    handle = ours.module.wte.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RuntimeError, match="the tied weight has a gradient hook"):
        ours(idx, tgt)
    handle.remove()
    from unittest import mock
    with mock.patch("pynccl.ddp.embedding_rows._capturing", return_value=True):
        with pytest.raises(RuntimeError, match="a CUDA graph is being captured"):
            ours(idx, tgt)
    assert rows.steps == [None]         # the refused forwards made no alias
    step("a DDP step after the refusals", lambda m: m(idx, tgt))
    assert rows.last_exchange == "rows"

    # backward(inputs=...) without the tied weight: it gets no gradient, as torch's (last: the
    # buckets of the other parameters stay unfinished, which the next forward reports, as torch's).
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
        m(idx, tgt).backward(inputs=[m.module.block[1].weight])
    assert ours.module.wte.weight.grad is None and ref.module.wte.weight.grad is None
    assert_within(ours.module.block[1].weight.grad, ref.module.block[1].weight.grad,
                  tol * ref.module.block[1].weight.grad.abs().max().item(), "backward(inputs=[one weight])")


def test_torch_semantics_of_the_tied_weight():
    _run(_torch_semantics)


def _which_heads(rank, ws):
    """Which modules the path handles: a plain nn.Linear head whose weight only nn.Embedding modules
    with torch's own forward also register; not an embedding subclass with a forward of its own
    (HF Gemma scales its lookup: a subclass may look up other rows than its ids name), a head
    subclass with its own forward, two heads on one weight, a sparse embedding or a parametrized
    weight. A model with a scaled embedding keeps torch's path and trains as torch DDP."""
    import torch
    import torch.distributed as tdist
    from torch import nn
    import pynccl
    from pynccl.ddp.embedding_rows import tied_heads
    from numerics import assert_within

    class Scaled(nn.Embedding):
        def forward(self, input):
            return super().forward(input) * 8.0

    class OwnHead(nn.Linear):
        def forward(self, input):
            return super().forward(input) * 0.5

    def tied(emb, head):
        m = nn.Sequential(emb, head)
        m[1].weight = m[0].weight
        return m
    scaled = tied(Scaled(6, 4), nn.Linear(4, 6, bias=False))
    assert tied_heads(scaled) == []
    plain = tied(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    assert tied_heads(plain) == [(plain[1], [plain[0]])]
    assert tied_heads(tied(nn.Embedding(6, 4), OwnHead(4, 6, bias=False))) == []
    assert tied_heads(tied(nn.Embedding(6, 4, sparse=True), nn.Linear(4, 6, bias=False))) == []
    two = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False))
    two[1].weight = two[0].weight
    two[2].weight = two[0].weight
    assert tied_heads(two) == []
    untied = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 4))
    nn.utils.parametrizations.weight_norm(untied[0])
    assert tied_heads(untied) == []

    def build():
        model = _model()
        model.wte = Scaled(VOCAB, DIM)
        model.lm_head.weight = model.wte.weight
        torch.manual_seed(1)
        nn.init.normal_(model.wte.weight, std=0.02)
        return model
    ours = pynccl.DistributedDataParallel(build())
    ref = torch.nn.parallel.DistributedDataParallel(build(), process_group=tdist.group.WORLD)
    assert ours.reducer.tied_rows is None
    for idx, tgt in _batches(rank, n=2):
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
            m(idx, tgt).backward()
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), name)


def test_which_heads_and_a_scaled_embedding():
    _run(_which_heads)


def _other_use(rank, ws, when):
    """The tied weight also used outside its head and lookups (a functional use: here a penalty on
    its norm). Found in the first step: that step's gradient is all-reduced whole and the path
    steps aside for good, equal to torch DDP; first appearing later, it raises, naming the option."""
    import torch
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within
    ours = pynccl.DistributedDataParallel(_model(), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(_model(), process_group=tdist.group.WORLD)

    def loss_of(m, step):
        loss = m(idx, tgt)
        if step >= when:
            loss = loss + 1e-3 * m.module.wte.weight.square().sum()
        return loss
    for step, (idx, tgt) in enumerate(_batches(rank, n=3)):
        if step == when and when > 0:
            ours.zero_grad(set_to_none=True)
            with pytest.raises(RuntimeError, match="from outside its head and its embeddings' lookups"):
                loss_of(ours, step).backward()
            return
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
            loss_of(m, step).backward()
        assert (ours.reducer.tied_rows is None) == (step >= when)
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), f"{step} {name}")


@pytest.mark.parametrize("when", [0, 1])
def test_another_use_of_the_tied_weight(when):
    _run(_other_use, when=when)




def _saved_and_copied(rank, ws):
    """torch.save of the whole module (not only its state_dict) and copy.deepcopy work with the
    head's forward installed; what comes back runs torch's linear, and the original stays on the path."""
    import copy
    import io
    import torch
    import pynccl
    import functools
    ours = pynccl.DistributedDataParallel(_hf_gpt2(), tied_embedding_rows=True)
    rows = ours.reducer.tied_rows
    idx, tgt = _batches(rank)[0]
    head = ours.module.lm_head
    h = torch.randn(2, DIM)
    assert "forward" not in vars(head)                             # installed only inside DDP's forward
    copies = []
    for inside in (False, True):                                   # saved and copied outside and inside it
        with rows.forward_window(inside):
            assert ("forward" in vars(head)) == inside
            with torch.no_grad():                                  # torch's parameter name works too
                assert torch.equal(head(input=h), head(h))
            buf = io.BytesIO()
            torch.save(ours.module, buf)
            buf.seek(0)
            copies += [(inside, torch.load(buf, weights_only=False)), (inside, copy.deepcopy(ours.module))]
    assert "forward" not in vars(head)
    for inside, other in copies:
        lm_head = other.lm_head
        if inside:                     # torch's own forward bound to the copy: loads without pynccl
            assert isinstance(vars(lm_head)["forward"], functools.partial) and lm_head.forward.args == (lm_head,)
        else:
            assert "forward" not in vars(lm_head)
        assert torch.equal(lm_head(h), torch.nn.functional.linear(h, lm_head.weight))
        other(input_ids=idx, labels=tgt).loss.backward()           # trains as a plain model
        assert other.transformer.wte.weight.grad is not None
    assert rows.steps == [None]
    ours(input_ids=idx, labels=tgt).loss.backward()
    assert rows.last_exchange == "rows"


def test_whole_module_saved_and_deep_copied():
    _run(_saved_and_copied)


def _compiled_inside(rank, ws):
    """nanoGPT's order: torch.compile(model), then DDP. The head is inside dynamo's graph, which
    traces torch's linear (no alias, no exchange), and the result equals torch DDP over the same
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


def _checkpointed(rank, ws, around):
    """Non-reentrant activation checkpointing (torch's recommended mode) around the embedding (and
    the head): its recompute runs in backward, outside DDP's forward, so under saved-tensor hooks
    the modules run torch's forward. Around the embedding alone, its gradient then reaches the
    weight past the aliases, which the first step finds (the path steps aside); around both,
    nothing reads the aliases. Equal to torch DDP either way."""
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
            if around == "everything":
                logits = checkpoint(lambda i: model.lm_head(trunk(i)), idx, use_reentrant=False)
            else:
                logits = model.lm_head(checkpoint(trunk, idx, use_reentrant=False))
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        model.forward = forward
        return model
    ours = pynccl.DistributedDataParallel(build(), tied_embedding_rows=True)
    ref = torch.nn.parallel.DistributedDataParallel(build(), process_group=tdist.group.WORLD)
    for idx, tgt in _batches(rank, n=2):
        for m in (ours, ref):
            m.zero_grad(set_to_none=True)
            m(idx, tgt).backward()
        if around == "trunk":        # the lookup's gradient came past the aliases: the first step turned it off
            assert ours.reducer.tied_rows is None
        else:                        # nothing read the aliases: nothing to exchange
            assert ours.reducer.tied_rows.last_exchange is None
        for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
            assert_within(p.grad, q.grad, _grad_rtol(ws, BATCH * SEQ) * q.grad.abs().max().item(), name)


@pytest.mark.parametrize("around", ["trunk", "everything"])
def test_activation_checkpointing(around):
    _run(_checkpointed, around=around)


def _pair(find_unused=False):
    """pynccl DDP with its defaults (the tied tail on) and torch DDP, on the same tiny tied LM."""
    import torch
    import torch.distributed as tdist
    import pynccl
    ours = pynccl.DistributedDataParallel(_model(), find_unused_parameters=find_unused)
    ref = torch.nn.parallel.DistributedDataParallel(_model(), process_group=tdist.group.WORLD,
                                                    find_unused_parameters=find_unused)
    assert ours.reducer.tied_rows is not None and not ours.reducer.tied_rows.explicit
    return ours, ref


def _same_grads(ours, ref, ws, what):
    from numerics import assert_within
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{what}: {name} has a grad on one side only"
        if q.grad is not None:
            assert_within(p.grad, q.grad, _grad_rtol(ws, 2 * BATCH * SEQ) * q.grad.abs().max().item(), f"{what}: {name}")


def _irregular_steps(rank, ws, case):
    """Steps torch DDP takes that break the tied tail's usual rhythm (session 13's review), each
    equal to torch DDP's gradients: two forwards before one backward after a normal step (the
    later head part joins the rest, which crosses densely); a forward whose backward is skipped,
    then join() or a hook on the tied weight (the default steps aside); the tied weight frozen
    mid-training under find_unused_parameters (its .grad stays None); a rank whose forward skips
    the tied modules under find_unused_parameters (it still joins the exchange: no hang)."""
    import torch
    ours, ref = _pair(find_unused=case in ("freeze", "branch"))
    (i0, t0), (i1, t1), (i2, t2) = _batches(rank, n=3)
    for m in (ours, ref):
        m(i0, t0).backward()
    _same_grads(ours, ref, ws, "first step")
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
    if case == "two_forwards":
        for m in (ours, ref):
            (m(i1, t1) + m(i2, t2)).backward()
        assert ours.reducer.tied_rows.last_exchange == "dense"
    elif case in ("stale_join", "stale_hook"):
        for m in (ours, ref):
            m(i1, t1)                                   # a forward whose backward is skipped
        if case == "stale_join":
            with ours.join(), ref.join():
                for m in (ours, ref):
                    m(i2, t2).backward()
        else:
            for m in (ours, ref):
                m.module.wte.weight.register_hook(lambda g: g * 1.0)
                m(i2, t2).backward()
        assert ours.reducer.tied_rows is None
    elif case == "freeze":
        for m in (ours, ref):
            m.module.wte.weight.requires_grad_(False)
            m(i1, t1).backward()
        assert ours.module.wte.weight.grad is None
    elif case == "branch":
        def forward(module, idx, tgt, lm):
            if lm:
                return type(module).forward(module, idx, tgt)
            h = module.wpe(torch.arange(idx.shape[1]))[None]
            return module.block(h).square().mean()
        for m in (ours, ref):
            m.module.forward = lambda idx, tgt, lm, _m=m.module: forward(_m, idx, tgt, lm)
            m(i1, t1, rank != 1).backward()             # rank 1 never calls the embedding or the head
    _same_grads(ours, ref, ws, case)


@pytest.mark.parametrize("case", ["two_forwards", "stale_join", "stale_hook", "freeze", "branch"])
def test_irregular_steps_equal_torch_ddp(case):
    _run(_irregular_steps, case=case)


def _rows_through_a_window(rank, ws, comm_path, hf=False):
    """The exchange's window branch (on CUDA an NCCL symmetric window: this rank's rows written into
    its own slot, then the all-gather in place) on gloo, with the window stood in by an ordinary
    tensor full of NaN (a row read from outside what was written poisons the gradient): equal to
    torch DDP's gradients every step, on the tiny tied LM and on HF's GPT2LMHeadModel. With
    comm_path "default" no window is made."""
    from unittest import mock
    import torch
    import torch.distributed as tdist
    import pynccl
    from pynccl.ddp.comm_path import CommPath
    made = []

    def window(group, sizes):
        (numel, dtype), = sizes
        made.append(torch.full((numel,), float("nan"), dtype=dtype))
        return [made[-1]]

    with mock.patch("pynccl.ddp.embedding_rows.alloc_symmetric", window):
        if hf:
            ours = pynccl.DistributedDataParallel(_hf_gpt2())
            ref = torch.nn.parallel.DistributedDataParallel(_hf_gpt2(), process_group=tdist.group.WORLD)
            assert ours.reducer.tied_rows is not None
        else:
            ours, ref = _pair()
        for step, (idx, tgt) in enumerate(_batches(rank, seq=SEQ - rank, n=3)):   # uneven counts
            for m in (ours, ref):
                m.zero_grad(set_to_none=True)
            loss = _loss(ours, idx, tgt, hf)
            ours.reducer.comm_path = CommPath(comm_path)    # after the forward: a rebuild resets it on gloo
            loss.backward()
            _loss(ref, idx, tgt, hf).backward()
            assert ours.reducer.tied_rows.last_exchange == "rows"
            _same_grads(ours, ref, ws, f"{comm_path} step {step}")
    if comm_path == "default":
        assert not made
    else:
        assert len(made) == 1 and made[0].numel() == ws * (VOCAB // ws) * DIM
        assert not torch.isnan(made[0]).all()              # the rows went through it


@pytest.mark.numerics
@pytest.mark.parametrize("comm_path,hf", [("copy_engine", False), ("copy_engine", True), ("default", False)])
def test_rows_through_a_symmetric_window_stand_in(comm_path, hf):
    _run(_rows_through_a_window, comm_path=comm_path, hf=hf)
