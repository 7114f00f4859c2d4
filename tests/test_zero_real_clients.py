"""ZeRO (pynccl.FullyShardedDataParallel) under code nobody here wrote: tiny Hugging Face GPT-2
(tied embeddings) and Llama (grouped-query attention), optimizers built the way nanoGPT's
configure_optimizers builds them (param groups by name and p.dim()), torch's AdamW / SGD in all
three implementations (for-loop, foreach, fused), HF activation checkpointing (both torch
checkpoint flavours), clipping through pynccl.clip_grad_norm_, optimizers that write through
p.data, and a block skipped by a conditional branch.

Every run is compared with the unwrapped model on one process and the whole batch (fp32):
losses of every step and the final parameters, within the fp32 rounding of the model's reductions
and what the optimizer makes of it (tests/numerics.py: AdamW's bound is element-wise, loose only
where a gradient is rounding noise, as GPT-2's attention key bias). The SGD runs make a missed
1/world_size scale visible (AdamW is scale-invariant); a skipped re-gather after a fused step (the
stage-1/2 bug this file was written for) leaves the loss flat and fails at step 2. One
multi-process run at world size 2 (3 for uneven shards) holds all of it.
"""
import pytest
import torch
import torch.utils.checkpoint
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
from torch import nn

import pynccl
from pynccl.testing import run_multiprocess
from numerics import assert_within, chain_rtol, record_grad_scale, trained_atol, transformer_rtol

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS, LR = 96, 16, 4, 5, 3e-3
HIDDEN, LAYERS, HEADS = 32, 3, 4
# Loss and gradients, relative: the models' reduction chain (GPT-2's MLP is 4 × 32 wide, Llama's 64),
# on BATCH = 6 sequences at world size 3; the loss mean over 6 × 16 tokens. 2.9e-4 relative.
GRAD_RTOL = transformer_rtol(LAYERS, HIDDEN, 4 * HIDDEN, HIDDEN // HEADS, SEQ, VOCAB, 6 * SEQ)


def branchy_rtol(num_blocks=3):
    """_Branchy's gradients: the embedding, num_blocks tanh blocks 16 wide and a 96-way head,
    forward and backward; the loss's softmax and mean over 6 × 16 tokens and the weight
    gradients' sum over them."""
    return chain_rtol(2 * (num_blocks * 16 + 16 + VOCAB), 2 * VOCAB, 2 * 6 * SEQ)
IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def make_model(kind: str, checkpointing=None):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=4,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        assert model.lm_head.weight is model.transformer.wte.weight      # tied
    else:
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    return model.train()


def batch(step):
    """Learnable sequences (each token a fixed function of the one before) from a random start,
    so five steps lower the loss visibly."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.empty(BATCH, SEQ, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(1, SEQ):
        x[:, t] = (x[:, t - 1] * 5 + 3) % VOCAB
    return x


def local(x, rank, ws):
    n = x.shape[0] // ws
    return x[rank * n:(rank + 1) * n]


def configure_optimizers(model, impl, opt="adamw"):
    """nanoGPT's recipe: decay every >= 2-d parameter, not biases and norms; by name."""
    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay = [p for n, p in param_dict.items() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}]
    if opt == "sgd":
        return torch.optim.SGD(groups, lr=0.5, momentum=0.9, **IMPLS[impl])
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), **IMPLS[impl])


def run(model, opt, rank=0, ws=1, clip=None, steps=STEPS, grad_scale=None):
    """The loop users write; returns the global loss of every step (mean over ranks).
    grad_scale (a dict): filled with each parameter's largest |gradient| (record_grad_scale)."""
    losses = []
    for step in range(steps):
        x = local(batch(step), rank, ws)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip is not None:
            if ws == 1:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                pynccl.clip_grad_norm_(model.parameters(), clip)
        if grad_scale is not None:
            record_grad_scale(model.parameters(), grad_scale)
        opt.step()
        opt.zero_grad()
        if ws > 1:
            loss = loss.detach().clone()
            pynccl.all_reduce(loss, op=pynccl.ReduceOp.AVG)
        losses.append(float(loss.detach()))
    return losses


def reference(kind, impl, opt="adamw", clip=None, checkpointing=None):
    """The unwrapped model on one process: its losses and its trained state (trained_state)."""
    model = make_model(kind, checkpointing)
    optimizer, scale = configure_optimizers(model, impl, opt), {}
    losses = run(model, optimizer, clip=clip, grad_scale=scale)
    return losses, trained_state(model, optimizer, scale, STEPS, GRAD_RTOL)


def trained_state(model, optimizer, grad_scale, steps, grad_rtol):
    """{state_dict key: (the reference's value, the element-wise bound a correct run stays within)}:
    numerics.trained_atol for a parameter (a tied one appears under both its keys), 0 for a buffer."""
    params = {p.data_ptr(): p for p in model.parameters()}
    out = {}
    for k, v in model.state_dict().items():
        p = params.get(v.data_ptr())
        atol = 0.0 if p is None else trained_atol(optimizer, p, grad_rtol, grad_scale.get(p), steps)
        out[k] = (v.detach().clone(), atol)
    return out


def check(what, losses, ref_losses, full_sd, ref_state):
    """Each step's loss within GRAD_RTOL (its reduction chain; the parameters' differences, first
    order in the loss, are far smaller); every state entry within its trained bound."""
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= GRAD_RTOL * abs(b), f"{what}: step {step} loss {a} vs {b} (losses {losses} vs {ref_losses})"
    assert losses[-1] < losses[0] - 1e-3, f"{what}: did not train: {losses}"
    for k, (v, atol) in ref_state.items():
        assert_within(full_sd[k], v, atol, f"{what} [{k}]")


def check_against(what, full_sd, ref_model, ref_opt, grad_scale, steps):
    """full_sd against a _Branchy reference trained by ref_opt for `steps` steps."""
    rtol = branchy_rtol(len(ref_model.blocks))
    for k, (v, atol) in trained_state(ref_model, ref_opt, grad_scale, steps, rtol).items():
        assert_within(full_sd[k], v, atol, f"{what} [{k}]")


def wrap(model, stage, **kw):
    return pynccl.FullyShardedDataParallel(model, stage=stage, bucket_cap_mb=0.01, **kw)


# ---------------------------------------------------------------------- checks run on every rank
def _param_groups_and_impls(rank, ws):
    for kind in ("gpt2", "llama"):
        plain_names = [n for n, _ in make_model(kind).named_parameters()]
        for impl in IMPLS:
            ref_losses, ref_sd = reference(kind, impl)
            for stage in (1, 2, 3):
                model = wrap(make_model(kind), stage)
                assert [n for n, _ in model.named_parameters()] == ["module." + n for n in plain_names]
                losses = run(model, configure_optimizers(model, impl), rank, ws)
                check(f"{kind} stage {stage} AdamW {impl}", losses, ref_losses, model.full_state_dict(), ref_sd)


def _sgd_scale_and_clip(rank, ws):
    """SGD sees the gradient's scale (a missed 1/world_size doubles the step); clipping with
    pynccl.clip_grad_norm_ equals torch's on the full gradients."""
    for impl in IMPLS:
        ref_losses, ref_sd = reference("llama", impl, opt="sgd")
        for stage in (1, 2, 3):
            model = wrap(make_model("llama"), stage)
            losses = run(model, configure_optimizers(model, impl, "sgd"), rank, ws)
            check(f"llama stage {stage} SGD {impl}", losses, ref_losses, model.full_state_dict(), ref_sd)
    ref_losses, ref_sd = reference("gpt2", "fused", clip=0.05)
    for stage in (1, 2, 3):
        model = wrap(make_model("gpt2"), stage)
        losses = run(model, configure_optimizers(model, "fused"), rank, ws, clip=0.05)
        check(f"gpt2 stage {stage} clipped", losses, ref_losses, model.full_state_dict(), ref_sd)


class _ThroughData(torch.optim.Optimizer):
    """Plain SGD written the old way, through p.data; rebind=True assigns a new tensor to p.data."""

    def __init__(self, params, lr, rebind=False):
        super().__init__(params, {"lr": lr})
        self.rebind = rebind

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if self.rebind:
                        p.data = p.data - g["lr"] * p.grad
                    else:
                        p.data.add_(p.grad, alpha=-g["lr"])


def _other_writers(rank, ws):
    ref = make_model("llama")
    ref_opt, scale = _ThroughData(ref.parameters(), 0.5), {}
    ref_losses = run(ref, ref_opt, grad_scale=scale)
    ref_sd = trained_state(ref, ref_opt, scale, STEPS, GRAD_RTOL)
    for stage, rebind in ((1, False), (2, True), (3, True)):
        model = wrap(make_model("llama"), stage)
        losses = run(model, _ThroughData(model.parameters(), 0.5, rebind), rank, ws)
        check(f"stage {stage} p.data optimizer (rebind={rebind})", losses, ref_losses, model.full_state_dict(), ref_sd)
    # nanoGPT builds its optimizer before wrapping: the parameters it holds become the shards.
    ref_losses, ref_sd = reference("gpt2", "fused")
    net = make_model("gpt2")
    opt = configure_optimizers(net, "fused")
    model = wrap(net, 2)
    losses = run(model, opt, rank, ws)
    check("optimizer built before wrapping", losses, ref_losses, model.full_state_dict(), ref_sd)


def _count_gathers(model, fn):
    """Run fn(); return (all-gathers started during backward, most non-root units gathered at
    once during backward)."""
    import pynccl.zero.flat_unit as fu
    units, root = model.units, model._runtime.root
    stats = [0, 0]
    real = fu.ShardedUnit.gather

    def counting(unit):
        if unit.gather_work is None and torch._C._current_graph_task_id() != -1:
            stats[0] += 1
            stats[1] = max(stats[1], sum(1 for u in units if u is not root and (u.is_allocated or u is unit)))
        real(unit)
    fu.ShardedUnit.gather = counting
    try:
        fn()
    finally:
        fu.ShardedUnit.gather = real
    return stats


def _checkpointing(rank, ws):
    """Activation checkpointing at stage 3, HF's (around each layer's forward) and torch's around
    a block's __call__, both flavours: same results; during backward at most two blocks (plus
    the root) are gathered at once, and each block at most once per backward (recomputation
    used to gather every block again and keep them all)."""
    for reentrant in (False, True):
        ref_losses, ref_sd = reference("llama", "fused", checkpointing=reentrant)
        model = wrap(make_model("llama", checkpointing=reentrant), 3)
        losses = []
        backward_gathers, peak = _count_gathers(model, lambda: losses.extend(
            run(model, configure_optimizers(model, "fused"), rank, ws)))
        check(f"HF checkpointing reentrant={reentrant}", losses, ref_losses, model.full_state_dict(), ref_sd)
        blocks = len(model.units) - 1
        assert peak <= 2 and STEPS * (blocks - 1) <= backward_gathers <= STEPS * blocks, (reentrant, peak,
                                                                                          backward_gathers)
        ref = _Branchy(checkpointing=reentrant)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        model = wrap(_Branchy(checkpointing=reentrant), 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        scale = {}

        def steps():
            for step in range(3):
                x = batch(step)
                ref(x).backward()
                model(local(x, rank, ws)).backward()
                record_grad_scale(ref.parameters(), scale)
                ref_opt.step(), opt.step()
                ref_opt.zero_grad(), opt.zero_grad()
        backward_gathers, peak = _count_gathers(model, steps)
        blocks = len(model.units)                      # the 3 blocks, the embedding and the head (no root left)
        full = model.full_state_dict()
        check_against("torch checkpoint", full, ref, ref_opt, scale, 3)
        assert blocks == 5 and peak <= 2 and backward_gathers <= 3 * blocks, (reentrant, blocks, peak, backward_gathers)


class _Branchy(nn.Module):
    """Three blocks; `skip` says which block this rank's forward leaves out."""

    def __init__(self, checkpointing=None, num_blocks=3):
        super().__init__()
        self.checkpointing = checkpointing             # None, or torch checkpoint's use_reentrant
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(num_blocks)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x, skip=()):
        h = self.emb(x)
        for i, b in enumerate(self.blocks):
            if i in skip:
                continue
            if self.checkpointing is None:
                h = h + b(h)
            else:
                h = h + torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.checkpointing)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())


def _conditional_units(rank, ws):
    """A unit skipped on some ranks (no hang, the mismatch is gone) and on all ranks (a zero
    gradient, not None). Expected: the average of each rank's own gradient, computed on one process."""
    skips = [lambda r: (1,) if r == 1 else (), lambda r: (0, 2), lambda r: ()]
    ref = _Branchy()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model = wrap(_Branchy(), 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scale = {}
    for step, skip in enumerate(skips):
        x = batch(step)
        sum(ref(local(x, r, ws), skip(r)) for r in range(ws)).div(ws).backward()
        record_grad_scale(ref.parameters(), scale)
        model(local(x, rank, ws), skip(rank)).backward()
        if step == 1:                                  # blocks 0 and 2 ran nowhere: zero, not None
            for name, p in model.named_parameters():
                if ".blocks.0." in name or ".blocks.2." in name:
                    assert p.grad is not None and not p.grad.any(), name
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    check_against("conditional", model.full_state_dict(), ref, ref_opt, scale, len(skips))
    # Eight blocks, one high up skipped on rank 1: the other ranks reduce it long before rank 1
    # does (at its end of backward), and must not wait for that reduce before starting the
    # all-gathers rank 1 still needs (that wait deadlocked, on gloo's host as on NCCL's streams).
    ref, model = _Branchy(num_blocks=8), wrap(_Branchy(num_blocks=8), 3)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    skip = lambda r: (6,) if r == 1 else ()            # noqa: E731
    scale = {}
    for step in range(2):
        x = batch(step)
        sum(ref(local(x, r, ws), skip(r)) for r in range(ws)).div(ws).backward()
        record_grad_scale(ref.parameters(), scale)
        model(local(x, rank, ws), skip(rank)).backward()
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    check_against("8 blocks", model.full_state_dict(), ref, ref_opt, scale, 2)


def _case(rank, ws):
    _param_groups_and_impls(rank, ws)
    if ws == 2:
        _sgd_scale_and_clip(rank, ws)
        _other_writers(rank, ws)
        _checkpointing(rank, ws)
    _conditional_units(rank, ws)
    return True


@pytest.mark.numerics
def test_real_clients_world_size_2():
    assert run_multiprocess(_case, 2, timeout=600) == [True, True]


@pytest.mark.numerics
def test_real_clients_world_size_3_uneven_rows():
    assert run_multiprocess(_ws3, 3, timeout=600) == [True] * 3


def _ws3(rank, ws):
    global BATCH
    BATCH = 6
    return _case(rank, ws)


def test_clip_grad_norm_errors():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), float("inf"))
    with pytest.raises(RuntimeError, match="total norm of order 2.0 is inf"):
        pynccl.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="max_norm must be a non-negative number"):
        pynccl.clip_grad_norm_([p], -1.0)
    q = nn.Parameter(torch.ones(4))
    q.grad = torch.full((4,), 2.0)
    norm = pynccl.clip_grad_norm_([q], 1.0)                  # plain tensors: torch's result, no process group
    assert float(norm) == pytest.approx(4.0) and torch.allclose(q.grad, torch.full((4,), 0.5), atol=1e-5)
