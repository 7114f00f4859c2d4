"""Tensor parallelism on gloo at TP = 2, 3 and 4 against the unsharded reference modules, same
weights, same data: outputs and every gradient (inputs, weights, biases) of each layer, the MLP,
attention, the block and a tied-embedding mini GPT, with and without sequence parallelism;
vocab-parallel cross-entropy against F.cross_entropy; divisibility errors; dropout RNG.
Sizes divide by 2, 3 and 4 (hidden 24, 12 heads, ffn 48, sequence 12), except the vocabulary
(49), which exercises padding. One process launch per TP size runs every check.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.testing import run_multiprocess
from pynccl.testing.reference_models import CausalSelfAttention, MLP, TransformerBlock
from numerics import assert_within, chain_rtol

S, B, H, HEADS, FFN, VOCAB = 12, 2, 24, 12, 48, 49
# Every comparison is relative to the expected tensor's largest element, within the fp32 rounding
# of the longest chain here (tests/numerics.py): the mini GPT's block forward and backward (the
# norms, q/k/v and proj: H; the scores: H / HEADS; softmax and P·V: S; fc: H; proj: FFN), its
# embedding and LayerNorm (H), logits and loss (VOCAB) and the sums over S × B tokens. A
# row-parallel layer sums its ranks' partial products in another order: inside these bounds.
FP32_TOL = chain_rtol(2 * (5 * H + H // HEADS + 2 * S + FFN), 2 * H, 2 * VOCAB, 2 * S * B)


def _randn(*shape, seed, device, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _seq_shard(t, group):
    return t.chunk(group.world_size, dim=0)[group.group_rank]


def _last_shard(t, group, num_chunks=1):
    return tp.shard_tensor(t, t.dim() - 1, group.group_rank, group.world_size, num_chunks)


def _close(actual, expected, what, tol):
    """|actual - expected| <= tol × max |expected|, element-wise."""
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_within(actual, expected.to(actual.dtype), tol * expected.detach().abs().max().item(), what)


def _compare(par, ref, x_full, group, what, tol, in_local=None, out_local=None, seed=0, input_grad=True):
    """Reference on the full input, parallel on this rank's part of it (in_local); backward with
    the same upstream grad (cut by out_local). Checks output, input grad and every param grad."""
    in_local = in_local or (lambda t: t)
    out_local = out_local or (lambda t: t)
    differentiable = x_full.is_floating_point() and input_grad
    x_ref = x_full.clone().requires_grad_(differentiable)
    y_ref = ref(x_ref)
    dy = _randn(*y_ref.shape, seed=seed + 1, device=y_ref.device, dtype=y_ref.dtype)
    y_ref.backward(dy)
    x_par = in_local(x_full).clone().requires_grad_(differentiable)
    y_par = par(x_par)
    _close(y_par, out_local(y_ref.detach()), f"{what}: output", tol)
    y_par.backward(out_local(dy))
    if differentiable:
        _close(x_par.grad, in_local(x_ref.grad), f"{what}: input grad", tol)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in par.named_parameters()]
    assert sorted(names) == sorted(ref_params), f"{what}: parameters {names} != {sorted(ref_params)}"
    for name, p in par.named_parameters():
        _close(p.grad, tp.shard_like(p, ref_params[name].grad, group), f"{what}: grad of {name}", tol)


def _comm_checks(group, dev, tol):
    """Each communication op's forward and backward against closed forms; rank r's input and
    upstream grad are drawn from seed r."""
    rank, ws = group.group_rank, group.world_size
    xs = [_randn(S, B, H, seed=100 + r, device=dev) for r in range(ws)]
    gs = [_randn(S, B, H, seed=200 + r, device=dev) for r in range(ws)]
    gs_small = [g.chunk(ws, 0)[r] for r, g in enumerate(gs)]
    gs_narrow = [g.chunk(ws, -1)[r] for r, g in enumerate(gs)]
    rows = lambda t, r: t.chunk(ws, 0)[r]  # noqa: E731
    cols = lambda t, r: t.chunk(ws, -1)[r]  # noqa: E731
    cases = [  # (name, fn, input of rank r, grad of rank r, expected output, expected input grad)
        ("copy_to", tp.copy_to_tensor_parallel_region, xs, gs, xs[rank], sum(gs)),
        ("reduce_from", tp.reduce_from_tensor_parallel_region, xs, gs, sum(xs), gs[rank]),
        ("scatter_to", tp.scatter_to_tensor_parallel_region, [xs[0]] * ws, gs_narrow, cols(xs[0], rank),
         torch.cat(gs_narrow, -1)),
        ("gather_from", tp.gather_from_tensor_parallel_region, [cols(x, r) for r, x in enumerate(xs)], gs,
         torch.cat([cols(x, r) for r, x in enumerate(xs)], -1), cols(gs[rank], rank)),
        ("scatter_to_sequence", tp.scatter_to_sequence_parallel_region, [xs[0]] * ws, gs_small, rows(xs[0], rank),
         torch.cat(gs_small, 0)),
        ("gather_from_sequence", tp.gather_from_sequence_parallel_region, [rows(x, r) for r, x in enumerate(xs)], gs,
         torch.cat([rows(x, r) for r, x in enumerate(xs)], 0), rows(sum(gs), rank)),
        ("gather_from_sequence (grad not partial)",
         lambda x, g: tp.gather_from_sequence_parallel_region(x, g, grad_is_partial=False),
         [rows(x, r) for r, x in enumerate(xs)], [gs[0]] * ws, torch.cat([rows(x, r) for r, x in enumerate(xs)], 0),
         rows(gs[0], rank)),
        ("reduce_scatter_to_sequence", tp.reduce_scatter_to_sequence_parallel_region, xs, gs_small,
         rows(sum(xs), rank), torch.cat(gs_small, 0)),
    ]
    t = lambda v: v.transpose(0, 1)  # noqa: E731  [s, b, h] -> Hugging Face's [b, s, h], sequence at dim 1
    cases += [(f"{name} seq_dim=1", lambda x, g, fn=fn: fn(x, g, seq_dim=1), [t(v) for v in inputs],
               [t(v) for v in grads], t(y), t(dx))
              for name, fn, inputs, grads, y, dx in cases
              if name in ("scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence")]
    for name, fn, inputs, grads, expected_y, expected_dx in cases:
        x = inputs[rank].clone().requires_grad_()
        y = fn(x, group)
        _close(y, expected_y, f"{name}: output", tol)
        y.backward(grads[rank].clone())
        _close(x.grad, expected_dx, f"{name}: input grad", tol)
    a, b = (torch.full((3,), float(rank + 1), device=dev, requires_grad=True) for _ in range(2))
    a2, b2 = tp.allreduce_grads_in_backward((a, b), group)
    (a2 * 2 + b2).sum().backward()
    _close(a.grad, torch.full((3,), 2.0 * ws, device=dev), "allreduce_grads_in_backward: grad", tol)
    _close(b.grad, torch.full((3,), 1.0 * ws, device=dev), "allreduce_grads_in_backward: grad", tol)
    # f(x) + w: the add hands one grad tensor to both; f's all-reduce must not write into w's (issue #18).
    # w = 2v is made before f, so its backward runs after f's and would read an all-reduced grad.
    x, v = (torch.zeros(3, device=dev, requires_grad=True) for _ in range(2))
    w = v * 2
    (tp.copy_to_tensor_parallel_region(x, group) + w).backward(torch.full((3,), rank + 1.0, device=dev))
    _close(v.grad, torch.full((3,), 2 * (rank + 1.0), device=dev), "copy_to with a shared grad: v.grad", tol)
    _close(x.grad, torch.full((3,), ws * (ws + 1) / 2, device=dev), "copy_to with a shared grad: x.grad", tol)


def _layer_checks(group, dev, dtype, tol):
    torch.manual_seed(0)
    seq = lambda t: _seq_shard(t, group)  # noqa: E731
    last = lambda t: _last_shard(t, group)  # noqa: E731
    for sp in (False, True):
        tag = f"tp={group.world_size} sp={sp}"
        x_h = _randn(S, B, H, seed=1, device=dev, dtype=dtype)
        x_ffn = _randn(S, B, FFN, seed=2, device=dev, dtype=dtype)
        for gather in (False, True):
            ref = nn.Linear(H, FFN, device=dev, dtype=dtype)
            for input_grad in (True, False):  # an input without grad (first layer): no dX collective
                ref.zero_grad()
                par = tp.ColumnParallelLinear.from_linear(ref, group, gather_output=gather, sequence_parallel=sp)
                _compare(par, ref, x_h, group, f"{tag} column gather={gather} input_grad={input_grad}", tol,
                         in_local=seq if sp else None, out_local=None if gather else last, input_grad=input_grad)
        ref = nn.Linear(H, 3 * H, bias=False, device=dev, dtype=dtype)
        par = tp.ColumnParallelLinear.from_linear(ref, group, sequence_parallel=sp, num_fused=3)
        _compare(par, ref, x_h, group, f"{tag} fused column", tol, in_local=seq if sp else None,
                 out_local=lambda t: _last_shard(t, group, 3))
        for parallel_in in (True, False):
            ref = nn.Linear(FFN, H, device=dev, dtype=dtype)
            par = tp.RowParallelLinear.from_linear(ref, group, input_is_parallel=parallel_in, sequence_parallel=sp)
            _compare(par, ref, x_ffn, group, f"{tag} row input_is_parallel={parallel_in}", tol,
                     in_local=last if parallel_in else None, out_local=seq if sp else None)
        tokens = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(3)).to(dev)
        tokens[0, 0] = VOCAB - 1
        ref = nn.Embedding(VOCAB, H, device=dev, dtype=dtype)
        par = tp.VocabParallelEmbedding.from_embedding(ref, group, sequence_parallel=sp)
        assert par.num_embeddings_padded % group.world_size == 0 and par.num_embeddings_padded >= VOCAB
        _compare(par, ref, tokens, group, f"{tag} embedding", tol, out_local=seq if sp else None)

        in_out = dict(in_local=seq, out_local=seq) if sp else {}
        ref = MLP(H, FFN, device=dev, dtype=dtype)
        _compare(tp.ParallelMLP.from_module(ref, group, sp), ref, x_h, group, f"{tag} MLP", tol, **in_out)
        ref = CausalSelfAttention(H, HEADS, device=dev, dtype=dtype)
        _compare(tp.ParallelCausalSelfAttention.from_module(ref, group, sp), ref, x_h, group, f"{tag} attention",
                 tol, **in_out)
        ref = TransformerBlock(H, HEADS, FFN, device=dev, dtype=dtype)
        _compare(tp.ParallelTransformerBlock.from_module(ref, group, sp), ref, x_h, group, f"{tag} block", tol,
                 **in_out)


class _MiniGPT(nn.Module):
    """Tied embedding -> block -> final LN -> logits: the reference for _ParallelMiniGPT."""

    def __init__(self, dev, dtype):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, H, device=dev, dtype=dtype)
        self.block = TransformerBlock(H, HEADS, FFN, device=dev, dtype=dtype)
        self.ln_f = nn.LayerNorm(H, device=dev, dtype=dtype)

    def loss(self, tokens, targets):
        logits = F.linear(self.ln_f(self.block(self.wte(tokens))), self.wte.weight)  # (s, b, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class _ParallelMiniGPT(nn.Module):
    def __init__(self, ref, group, sp):
        super().__init__()
        self.group = group
        self.wte = tp.VocabParallelEmbedding.from_embedding(ref.wte, group, sequence_parallel=sp)
        self.block = tp.ParallelTransformerBlock.from_module(ref.block, group, sp)
        self.ln_f = tp.ParallelLayerNorm.from_layernorm(ref.ln_f, group, sp)

    def loss(self, tokens, targets):
        logits = self.wte.lm_logits(self.ln_f(self.block(self.wte(tokens))))  # (s, b, V_padded/tp)
        return tp.vocab_parallel_cross_entropy(logits, targets, self.group, vocab_size=self.wte.num_embeddings)


def _gpt_checks(group, dev, dtype, tol):
    tokens = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(4)).to(dev)
    targets = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(5)).to(dev)
    targets[1, :] = -100  # ignored
    for sp in (False, True):
        torch.manual_seed(1)
        ref = _MiniGPT(dev, dtype)
        par = _ParallelMiniGPT(ref, group, sp)
        ref_loss = ref.loss(tokens, targets)
        ref_loss.backward()
        par_loss = par.loss(tokens, targets)
        par_loss.backward()
        _close(par_loss, ref_loss.detach().to(par_loss.dtype), f"mini GPT sp={sp}: loss", tol)
        ref_params = dict(ref.named_parameters())
        for name, p in par.named_parameters():
            _close(p.grad, tp.shard_like(p, ref_params[name].grad, group), f"mini GPT sp={sp}: grad of {name}", tol)


def _cross_entropy_checks(group, dev, tol):
    n = 10
    for vocab in (VOCAB, 48):
        per_rank = -(-vocab // group.world_size)
        logits = _randn(n, vocab, seed=6, device=dev) * 3
        target = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7)).to(dev)
        target[2] = -100
        target[3] = vocab - 1
        padded = torch.cat([logits, torch.full((n, per_rank * group.world_size - vocab), 1e3, device=dev)], 1)
        for reduction in ("mean", "sum", "none"):
            full = logits.clone().requires_grad_()
            ref = F.cross_entropy(full, target, reduction=reduction)
            ref.backward(torch.linspace(0.5, 1.5, n, device=dev) if reduction == "none" else None)
            shard = _last_shard(padded, group).clone().requires_grad_()
            loss = tp.vocab_parallel_cross_entropy(shard, target, group, reduction=reduction, vocab_size=vocab)
            loss.backward(torch.linspace(0.5, 1.5, n, device=dev) if reduction == "none" else None)
            what = f"cross entropy V={vocab} {reduction}"
            _close(loss, ref.detach(), f"{what}: loss", tol)
            grad_padded = torch.cat([full.grad, full.grad.new_zeros(n, padded.shape[1] - vocab)], 1)
            _close(shard.grad, _last_shard(grad_padded, group), f"{what}: grad wrt logits", tol)
    # Leading dims are kept: (s, b, V/tp) logits, (s, b) targets.
    logits = _randn(S, B, 48, seed=8, device=dev)
    target = torch.randint(0, 48, (S, B), generator=torch.Generator().manual_seed(9)).to(dev)
    loss = tp.vocab_parallel_cross_entropy(_last_shard(logits, group), target, group, reduction="none")
    _close(loss, F.cross_entropy(logits.reshape(-1, 48), target.reshape(-1), reduction="none").view(S, B),
           "cross entropy (s, b, V) layout", tol)
    with pytest.raises(ValueError, match="target's shape"):
        tp.vocab_parallel_cross_entropy(_last_shard(logits, group), target[:-1], group)
    with pytest.raises(ValueError, match="reduction"):
        tp.vocab_parallel_cross_entropy(_last_shard(logits, group), target, group, reduction="avg")


def _init_checks(group, dev):
    """Built from sizes = the unsharded module built under the same RNG state, sharded."""
    torch.manual_seed(11)
    ref = nn.ModuleDict({"block": TransformerBlock(H, HEADS, FFN, device=dev), "wte": nn.Embedding(VOCAB, H,
                                                                                                       device=dev)})
    torch.manual_seed(11)
    par = nn.ModuleDict({"block": tp.ParallelTransformerBlock(H, HEADS, FFN, group=group, device=dev),
                         "wte": tp.VocabParallelEmbedding(VOCAB, H, group=group, device=dev)})
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        assert torch.equal(p, tp.shard_like(p, ref_params[name].detach(), group)), f"init of {name}"


def _error_checks(group, dev):
    ws = group.world_size
    odd = 4 * ws + 1
    with pytest.raises(ValueError, match=rf"ColumnParallelLinear: out_features={odd} is not divisible by tp={ws}"):
        tp.ColumnParallelLinear(H, odd, group=group)
    with pytest.raises(ValueError, match=rf"RowParallelLinear: in_features={odd} is not divisible by tp={ws}"):
        tp.RowParallelLinear(odd, H, group=group)
    with pytest.raises(ValueError, match=rf"ParallelMLP: ffn_hidden_size={odd} is not divisible by tp={ws}"):
        tp.ParallelMLP(H, odd, group=group)
    heads = ws + 1
    with pytest.raises(ValueError, match=rf"ParallelCausalSelfAttention: num_heads={heads} is not divisible by tp={ws}"):
        tp.ParallelTransformerBlock(2 * heads, heads, group=group)
    with pytest.raises(ValueError, match=r"hidden_size \(10\) must be a multiple of num_heads \(4\)"):
        tp.ParallelCausalSelfAttention(10, 4, group=group)
    with pytest.raises(ValueError, match="num_fused"):
        tp.ColumnParallelLinear(H, 3 * H, gather_output=True, num_fused=3, group=group)
    emb = tp.VocabParallelEmbedding(VOCAB, H, group=group, sequence_parallel=True, device=dev)
    with pytest.raises(ValueError, match=rf"sequence dim .* divisible by the tensor-parallel size \({ws}\)"):
        emb(torch.zeros(S + 1, B, dtype=torch.long, device=dev))
    with pytest.raises(ValueError, match=rf"sequence dim .* \({ws}\)"):
        tp.scatter_to_sequence_parallel_region(torch.zeros(S + 1, B, H, device=dev), group)
    with pytest.raises(ValueError, match=rf"last dim .* \({ws}\)"):
        tp.scatter_to_tensor_parallel_region(torch.zeros(S, B, H + 1, device=dev), group)


def _gather_all(t, group):
    out = torch.empty((group.world_size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
    pynccl.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def _rng_checks(group, dev):
    rank, ws = group.group_rank, group.world_size
    tracker = tp.get_rng_tracker()
    tracker.reset()
    block = tp.ParallelTransformerBlock(H, HEADS, FFN, dropout=0.5, attn_dropout=0.5, group=group, device=dev)
    with pytest.raises(RuntimeError, match="model_parallel_seed"):
        block(_randn(S, B, H, seed=1, device=dev))

    tp.model_parallel_seed(1234, rank)
    replicated = torch.rand(8, device=dev)
    with tracker.fork(device=dev):
        sharded = torch.rand(8, device=dev)
    after = torch.rand(8, device=dev)
    # The default generator runs as if the fork never happened; the fork draws seed + 2718 + tp_rank.
    default = torch.Generator(device=dev).manual_seed(1234)
    assert torch.equal(replicated, torch.rand(8, generator=default, device=dev)), "default generator not seeded"
    assert torch.equal(after, torch.rand(8, generator=default, device=dev)), "fork disturbed the default generator"
    tp_gen = torch.Generator(device=dev).manual_seed(1234 + 2718 + rank)
    assert torch.equal(sharded, torch.rand(8, generator=tp_gen, device=dev)), "fork not seeded seed + 2718 + tp_rank"
    replicated_all, sharded_all = _gather_all(replicated, group), _gather_all(sharded, group)
    assert all(torch.equal(replicated_all[0], r) for r in replicated_all), "replicated draws differ across TP ranks"
    assert len({tuple(r.tolist()) for r in sharded_all}) == ws, "sharded draws repeat across TP ranks"
    saved = tracker.get_states()
    with tracker.fork(device=dev):
        first = torch.rand(4, device=dev)
    tracker.set_states(saved)
    with tracker.fork(device=dev):
        assert torch.equal(torch.rand(4, device=dev), first), "set_states did not restore the tracker"

    # Dropout in a block: replicated activations stay identical across ranks without sequence
    # parallelism; sequence-parallel shards each draw their own masks.
    x = _randn(S, B, H, seed=1, device=dev)
    block.train()
    y = block(x)
    assert not torch.allclose(y, block.eval()(x)), "dropout had no effect"
    y_all = _gather_all(y.detach(), group)
    assert all(torch.equal(y_all[0], r) for r in y_all), "block output differs across TP ranks under dropout"
    mlp = tp.ParallelMLP(H, FFN, dropout=0.5, group=group, sequence_parallel=True, device=dev)
    for p in mlp.parameters():  # every output element nonzero before dropout: zeros are the mask
        nn.init.constant_(p, 0.01)
    masks = _gather_all(mlp(torch.ones(S // ws, B, H, device=dev)).eq(0).to(torch.uint8), group)
    assert len({tuple(m.flatten().tolist()) for m in masks}) == ws, "sequence-parallel shards share a dropout mask"
    # Attention dropout acts on this rank's heads: with every head computing the same thing, the
    # (dropped-out) input of proj still differs across ranks.
    attn = tp.ParallelCausalSelfAttention(H, HEADS, attn_dropout=0.5, group=group, device=dev)
    for p in attn.parameters():
        nn.init.constant_(p, 0.01)
    seen = []
    attn.proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    attn(x)
    heads_out = _gather_all(seen[0], group)
    assert len({tuple(h.flatten().tolist()) for h in heads_out}) == ws, "TP ranks share attention dropout masks"
    tracker.reset()


def _subgroup_checks(dev, tol):
    """Two TP groups of 2 in a world of 4 (ParallelMesh dp=2 × tp=2): group ranks, not global
    ranks, pick the shards."""
    mesh = pynccl.ParallelMesh(dp=2, tp=2)
    group = mesh.tp_group
    assert group.group_rank == mesh.tp_rank and group.world_size == 2
    torch.manual_seed(2)
    ref = TransformerBlock(H, HEADS, FFN, device=dev)
    x = _randn(S, B, H, seed=3, device=dev)
    seq = lambda t: _seq_shard(t, group)  # noqa: E731
    _compare(tp.ParallelTransformerBlock.from_module(ref, group, True), ref, x, group, "TP subgroup block", tol,
             in_local=seq, out_local=seq)


def check_tensor_parallel(rank, world_size, dtype=torch.float32, tol=None):
    """Every check, on the default group; shared with tests/test_tensor_parallel_gpu.py."""
    tol = tol or FP32_TOL
    group = pynccl.get_default_group()
    dev = pynccl.get_device(group)
    if dtype == torch.float32:
        _comm_checks(group, dev, tol)
    _layer_checks(group, dev, dtype, tol)
    _gpt_checks(group, dev, dtype, tol)
    if dtype == torch.float32:
        _cross_entropy_checks(group, dev, tol)
        _init_checks(group, dev)
        _rng_checks(group, dev)
    if world_size > 1:
        _error_checks(group, dev)
    if world_size == 4:
        _subgroup_checks(dev, tol)
    return True


@pytest.mark.numerics
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_tensor_parallel_gloo(world_size):
    assert run_multiprocess(check_tensor_parallel, world_size, timeout=120) == [True] * world_size


def test_shard_tensor_fused_blocks():
    full = torch.arange(12).view(12, 1)  # [q0 q1 | k0 k1 | v0 v1] for 2 ranks, 2 rows each block
    assert tp.shard_tensor(full, 0, 1, 2, num_chunks=3).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert tp.shard_tensor(full, 0, 0, 3).flatten().tolist() == [0, 1, 2, 3]


def test_rng_tracker_without_processes():
    tracker = tp.RNGStatesTracker()
    tracker.add("a", 5)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 6)
    with pytest.raises(ValueError, match="seed 5 is already used"):
        tracker.add("b", 5)
    with pytest.raises(RuntimeError, match="never seeded"):
        with tracker.fork("b"):
            pass
    with pytest.raises(ValueError, match="tp_rank must be >= 0"):
        tp.model_parallel_seed(1, -1)


# ----------------------------------------------------------------------------- independent references
def _hf_gpt2_with_block(ref):
    """Hugging Face's GPT2Model (eager attention: explicit scores, causal mask and softmax; no
    dropout; positions zeroed) whose first block holds `ref`'s weights (Conv1D keeps them as (in, out))."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=H, n_layer=2, n_head=HEADS, n_inner=FFN, n_positions=S,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "eager"
    hf = transformers.GPT2Model(cfg)
    block = hf.h[0]
    with torch.no_grad():
        hf.wpe.weight.zero_()
        for theirs, ours in ((block.ln_1, ref.ln1), (block.ln_2, ref.ln2)):
            theirs.load_state_dict(ours.state_dict())
        for theirs, ours in ((block.attn.c_attn, ref.attn.qkv), (block.attn.c_proj, ref.attn.proj),
                             (block.mlp.c_fc, ref.mlp.fc), (block.mlp.c_proj, ref.mlp.proj)):
            theirs.weight.copy_(ours.weight.t())
            theirs.bias.copy_(ours.bias)
    return hf, {"ln1": block.ln_1, "ln2": block.ln_2, "attn.qkv": block.attn.c_attn, "attn.proj": block.attn.c_proj,
                "mlp.fc": block.mlp.c_fc, "mlp.proj": block.mlp.c_proj}


# One block, forward and backward (tests/numerics.py): the norms, q/k/v and proj (H), the scores
# (H / HEADS), softmax and P·V (S each), fc (H) and proj (FFN): relative to each tensor's largest.
BLOCK_RTOL = chain_rtol(2 * (5 * H + H // HEADS + 2 * S + FFN))


@pytest.mark.numerics
def test_reference_block_is_hugging_face_gpt2_and_torch_attention():
    """Every TP test compares against pynccl.testing.reference_models, which shares its attention
    and activation with the TP layers (tensor_parallel.functional): a bug there would pass them all.
    So the reference block itself is checked against code pynccl did not write: Hugging Face's
    GPT2Block (output, input gradient and every weight gradient) and torch's nn.MultiheadAttention
    with a causal mask (the attention alone)."""
    torch.manual_seed(0)
    ref = TransformerBlock(H, HEADS, FFN)
    with torch.no_grad():           # pre-activations of order 1-3, where GELU's tanh and erf forms differ (~5e-4)
        ref.mlp.fc.weight.mul_(4.0)
    hf, modules = _hf_gpt2_with_block(ref)
    x = _randn(S, B, H, seed=1, device="cpu")
    dy = _randn(S, B, H, seed=2, device="cpu")
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    x_hf = x.transpose(0, 1).clone().requires_grad_()                 # HF's (b, s, h)
    y_hf = hf(inputs_embeds=x_hf, output_hidden_states=True).hidden_states[1]   # the first block's output
    y_hf.backward(dy.transpose(0, 1))

    def close(actual, expected, what):
        assert_within(actual, expected, BLOCK_RTOL * expected.abs().max().item(), what)
    close(y_ref, y_hf.transpose(0, 1), "block output vs HF GPT2Block")
    close(x_ref.grad, x_hf.grad.transpose(0, 1), "block input grad vs HF GPT2Block")
    for prefix, theirs in modules.items():
        ours = ref.get_submodule(prefix)
        transpose = prefix not in ("ln1", "ln2")                        # Conv1D: (in, out)
        close(ours.weight.grad, theirs.weight.grad.t() if transpose else theirs.weight.grad, f"{prefix}.weight grad")
        close(ours.bias.grad, theirs.bias.grad, f"{prefix}.bias grad")

    mha = nn.MultiheadAttention(H, HEADS)                               # (s, b, h), packed [q | k | v]
    with torch.no_grad():
        mha.in_proj_weight.copy_(ref.attn.qkv.weight)
        mha.in_proj_bias.copy_(ref.attn.qkv.bias)
        mha.out_proj.weight.copy_(ref.attn.proj.weight)
        mha.out_proj.bias.copy_(ref.attn.proj.bias)
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)   # True: not attended
        close(ref.attn(x), mha(x, x, x, attn_mask=causal, need_weights=False)[0], "attention vs nn.MultiheadAttention")
