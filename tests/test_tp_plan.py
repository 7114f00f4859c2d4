"""Tensor parallelism by plan on unmodified Hugging Face models (tiny configs, random init), on
gloo at TP 2 and 4 in one 4-process run (the world is TP 4; a ParallelMesh(dp=2, tp=2) gives
two TP-2 groups). Each check builds the model, copies it, parallelizes the copy, runs
`model(input_ids=x, labels=x)` and backward on both, and compares the loss, the logits and every
parameter's grad with the matching slice of the unsharded model's (fp32, within the rounding of the
model's reductions, tests/numerics.py): Llama with
grouped-query attention and GPT-2 (fused Conv1D q|k|v, tied LM head), with and without sequence
parallelism (split along the sequence, or along the batch: sequence_dim=0) and the
vocabulary-parallel loss, with activation checkpointing; a non-HF model with
torchtitan-style layouts. Then the full state dict gathered back from the
shards equals the original's and loads into a fresh model; sizes that do not divide raise
ValueError naming the dimension, before the model is touched.
"""
import copy

import pytest
import torch
import torch.nn as nn

import pynccl
import pynccl.tensor_parallel as tp
from pynccl.testing import run_multiprocess
from numerics import assert_within, transformer_rtol

transformers = pytest.importorskip("transformers")

BATCH, SEQ_LEN, VOCAB = 2, 8, 128
# Relative to each expected tensor's largest element: the reduction chain of the largest model
# here (2 layers, hidden 64, ffn 128, head_dim 16 at 4 heads, seq 8, vocab 128, 2 × 8 tokens).
FP32_TOL = transformer_rtol(2, 64, 128, 16, SEQ_LEN, VOCAB, BATCH * SEQ_LEN)
TWO_PER_RANK_TOL = transformer_rtol(2, 64, 128, 16, SEQ_LEN, VOCAB, 8 * SEQ_LEN)  # the batch of 8 at tp 4


def llama_config(heads=4, kv_heads=2, attn="sdpa", **overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
              num_key_value_heads=kv_heads, max_position_embeddings=64, attention_dropout=0.0)
    kw.update(overrides)
    cfg = transformers.LlamaConfig(**kw)
    cfg._attn_implementation = attn
    return cfg


def gpt2_config(**overrides):
    kw = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.GPT2Config(**kw)


def build(config, seed=0):
    torch.manual_seed(seed)
    cls = transformers.GPT2LMHeadModel if isinstance(config, transformers.GPT2Config) else \
        transformers.LlamaForCausalLM
    return cls(config)


def tokens(seed=1, device="cpu", batch=BATCH):
    return torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(seed)).to(device)


def _close(actual, expected, what, tol):
    """|actual - expected| <= tol × max |expected|, element-wise."""
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_within(actual, expected.to(actual.dtype), tol * expected.detach().abs().max().item(), what)


def check_plan(config, plan, group, what, tol=FP32_TOL, device="cpu", dtype=torch.float32, close=None,
               checkpointing=False, batch=BATCH):
    """Loss, logits and every grad of the parallelized copy against the unsharded model.
    close(actual, expected, what, tol): the comparison (default: elementwise within tol).
    checkpointing: the copy recomputes each layer in backward (its collectives run again)."""
    compare = close or _close
    ref = build(config).to(device, dtype)
    par = tp.parallelize_module(copy.deepcopy(ref), group, plan)
    group = group or pynccl.get_default_group()  # None: parallelize_module's default group
    if checkpointing:
        par.gradient_checkpointing_enable()
        par.train()
    x = tokens(device=device, batch=batch)
    ref_out = ref(input_ids=x, labels=x)
    ref_out.loss.backward()
    out = par(input_ids=x, labels=x)
    out.loss.backward()
    compare(out.loss, ref_out.loss.detach(), f"{what}: loss", tol)
    full_vocab = out.logits.shape[-1] == VOCAB
    expected_logits = ref_out.logits.detach() if full_vocab else \
        ref_out.logits.detach().chunk(group.world_size, -1)[group.group_rank]
    compare(out.logits, expected_logits, f"{what}: logits", tol)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in par.named_parameters()]
    assert names == list(ref_params), f"{what}: parameter names changed: {names} != {list(ref_params)}"
    for name, p in par.named_parameters():
        compare(p.grad, tp.shard_like(p, ref_params[name].grad, group), f"{what}: grad of {name}", tol)
    return ref, par


def _state_dict_checks(ref, par, group, what):
    full = tp.unsharded_state_dict(par, group)
    expected = ref.state_dict()
    assert sorted(full) == sorted(expected), f"{what}: state dict keys differ"
    for key, value in expected.items():
        assert torch.equal(full[key], value), f"{what}: {key} gathered from the shards differs"
    fresh = type(ref)(ref.config)
    fresh.load_state_dict(full)  # strict: every key of the plain model, the full shapes
    x = tokens(seed=3)
    with torch.no_grad():
        _close(fresh(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss, f"{what}: reloaded loss",
               FP32_TOL)


def _error_checks(group):
    ws = group.world_size
    ok = dict(heads=8, kv_heads=4)  # divisible by 2 and 4
    cases = [
        (llama_config(heads=4, kv_heads=ws // 2 if ws > 2 else 1), tp.plans.llama(),
         rf"self_attn: num_key_value_heads={ws // 2 if ws > 2 else 1} is not divisible by tp={ws}"),
        (llama_config(heads=ws + 1, kv_heads=ws + 1, hidden_size=8 * (ws + 1)), tp.plans.llama(),
         rf"self_attn: num_attention_heads={ws + 1} is not divisible by tp={ws}"),
        (llama_config(**ok, intermediate_size=4 * ws + 1), tp.plans.llama(),
         rf"mlp.gate_proj: out_features={4 * ws + 1} is not divisible by tp={ws}"),
        (llama_config(**ok, vocab_size=VOCAB + 1), tp.plans.llama(),
         rf"embed_tokens: num_embeddings={VOCAB + 1} is not divisible by tp={ws} \(pad"),
        (gpt2_config(n_head=ws + 1, n_embd=8 * (ws + 1)), tp.plans.gpt2(),
         rf"attn: num_heads={ws + 1} is not divisible by tp={ws}"),
    ]
    for config, plan, message in cases:
        model = build(config)
        before = {n: p.shape for n, p in model.named_parameters()}
        with pytest.raises(ValueError, match=message):
            tp.parallelize_module(model, group, plan)
        assert {n: p.shape for n, p in model.named_parameters()} == before, f"{message}: model changed"
    with pytest.raises(ValueError, match=rf"qkv: out_features=9 is not divisible by 3 fused blocks × tp={ws}"):
        tp.parallelize_module(nn.ModuleDict({"qkv": nn.Linear(4, 9)}), group, {"qkv": tp.ColwiseParallel(num_fused=3)})
    gathered_head = {**tp.plans.llama(loss_parallel=True), "lm_head": tp.ColwiseParallel(output_layouts=tp.Replicate())}
    with pytest.raises(ValueError, match="LM head must be ColwiseParallel"):
        tp.parallelize_module(build(llama_config(**ok)), group, gathered_head)
    model = tp.parallelize_module(build(llama_config(**ok)), group, tp.plans.llama())
    with pytest.raises(ValueError, match="already tensor-parallel"):
        tp.parallelize_module(model, group, tp.plans.llama())
    sp_model = tp.parallelize_module(build(llama_config(**ok)), group, tp.plans.llama(sequence_parallel=True))
    odd = torch.zeros(1, SEQ_LEN + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"sequence dim \(.*: dim 1 .*\) must be divisible .*\({ws}\)"):
        sp_model(input_ids=odd, labels=odd)
    batch_model = tp.parallelize_module(build(llama_config(**ok)), group, tp.plans.llama(True, sequence_dim=0))
    odd_batch = torch.zeros(ws + 1, SEQ_LEN, dtype=torch.long)
    with pytest.raises(ValueError,
                       match=rf"sequence dim \(.*: dim 0 of shape \({ws + 1}, .*\) must be divisible .*\({ws}\)"):
        batch_model(input_ids=odd_batch, labels=odd_batch)
    for plans_of in (tp.plans.llama, tp.plans.gpt2):
        for bad in (2, -1, True, "1", None):
            for sp in (True, False):
                with pytest.raises(ValueError, match=rf"sequence_dim must be 0 \(the batch\) or 1 .*got {bad!r}"):
                    plans_of(sp, sequence_dim=bad)
    # The model slices its final hidden states for logits_to_keep before lm_head gathers them: under
    # sequence parallelism that would be a token shard, so a partial one is refused (any split).
    x = tokens(batch=2 * ws)                 # divisible by the TP size for either split
    for dim in (0, 1):
        for loss_parallel in (True, False):
            model = tp.parallelize_module(build(llama_config(**ok)), group,
                                          tp.plans.llama(True, loss_parallel, sequence_dim=dim))
            for keep in (1, torch.tensor([SEQ_LEN - 1])):
                with pytest.raises(ValueError, match="logits_to_keep=.* under sequence parallelism"):
                    model(input_ids=x, logits_to_keep=keep)
            assert model(input_ids=x, logits_to_keep=0).logits.shape[:2] == (2 * ws, SEQ_LEN)


def _sequence_dim_checks(group):
    """What a norm between the blocks sees: this rank's slab of the sequence (sequence_dim=1) or of
    the batch (sequence_dim=0), for Llama and GPT-2 (the values are check_plan's business)."""
    ws = group.world_size
    x = tokens()
    for config, plans_of, norm_of in ((llama_config(4, 2), tp.plans.llama, lambda m: m.model.layers[0].input_layernorm),
                                      (gpt2_config(), tp.plans.gpt2, lambda m: m.transformer.h[0].ln_1)):
        for dim, shape in ((1, (BATCH, SEQ_LEN // ws)), (0, (BATCH // ws, SEQ_LEN))):
            model = tp.parallelize_module(build(config), group, plans_of(True, sequence_dim=dim))
            seen = []
            norm_of(model).register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape[:2])))
            model(input_ids=x, labels=x).loss.backward()
            assert seen == [shape], f"{type(model).__name__} sequence_dim={dim}: the norm saw {seen}, expected {shape}"


class _TinyLM(nn.Module):
    """[b, s, h] embedding -> pre-norm MLP block with biases -> norm -> LM head, no Hugging Face."""

    def __init__(self, hidden=16, ffn=32):
        super().__init__()
        self.emb, self.norm, self.norm_f = nn.Embedding(VOCAB, hidden), nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(self.norm_f(h))


def _generic_plan_checks(group):
    """Styles DTensor-style plans use that the Hugging Face plans do not: the embedding's output
    reduce-scattered on the sequence (torchtitan), column layers gathering their input themselves,
    a row layer slicing a whole input, an embedding split along its features."""
    sp_plan = {"emb": tp.RowwiseParallel(input_layouts=tp.Replicate(), output_layouts=tp.Shard(1)),
               "norm": tp.SequenceParallel(), "norm_f": tp.SequenceParallel(),
               "up": tp.ColwiseParallel(input_layouts=tp.Shard(1)),
               "down": tp.RowwiseParallel(output_layouts=tp.Shard(1)),
               "head": tp.ColwiseParallel(input_layouts=tp.Shard(1), output_layouts=tp.Replicate())}
    plain_plan = {"emb": tp.ColwiseParallel(output_layouts=tp.Replicate()),
                  "up": tp.ColwiseParallel(output_layouts=tp.Replicate()),
                  "down": tp.RowwiseParallel(input_layouts=tp.Replicate()), "head": tp.ColwiseParallel()}
    x = tokens()
    for what, plan, out_local in (("sequence-parallel", sp_plan, lambda t: t),
                                  ("plain", plain_plan, lambda t: t.chunk(group.world_size, -1)[group.group_rank])):
        torch.manual_seed(5)
        ref = _TinyLM()
        par = tp.parallelize_module(copy.deepcopy(ref), group, plan)
        y_ref, y = ref(x), par(x)
        _close(y, out_local(y_ref.detach()), f"tiny LM {what}: output", FP32_TOL)
        dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(6))
        y_ref.backward(dy)
        y.backward(out_local(dy))
        ref_params = dict(ref.named_parameters())
        for name, p in par.named_parameters():
            _close(p.grad, tp.shard_like(p, ref_params[name].grad, group), f"tiny LM {what}: grad of {name}",
                   FP32_TOL)


def plan_checks(group, heads, kv_heads, device="cpu", dtype=torch.float32, tol=FP32_TOL, close=None):
    """Every plan variant at this group's TP size; returns how many ran."""
    ws = group.world_size
    count = 0
    for sp in (False, True):
        for loss_parallel in (True, False):
            what = f"llama tp={ws} sp={sp} loss_parallel={loss_parallel}"
            check_plan(llama_config(heads, kv_heads), tp.plans.llama(sp, loss_parallel), group, what, tol, device,
                       dtype, close)
            count += 1
        what = f"gpt2 tp={ws} sp={sp}"
        check_plan(gpt2_config(), tp.plans.gpt2(sp, loss_parallel=sp), group, what, tol, device, dtype, close)
        count += 1
    check_plan(llama_config(heads, kv_heads, attn="eager"), tp.plans.llama(True), group, f"llama eager tp={ws}", tol,
               device, dtype, close)
    check_plan(llama_config(heads, kv_heads), tp.plans.llama(True), group, f"llama checkpointing tp={ws}", tol, device,
               dtype, close, checkpointing=True)
    check_plan(llama_config(heads, kv_heads, tie_word_embeddings=True), tp.plans.llama(True), group,
               f"llama tied embeddings tp={ws}", tol, device, dtype, close)  # as Llama 3.2 1B / 3B
    count += 3
    if BATCH % ws == 0:  # sequence parallelism split along the batch (sequence_dim=0): the batch must divide
        for loss_parallel in (True, False):
            check_plan(llama_config(heads, kv_heads), tp.plans.llama(True, loss_parallel, sequence_dim=0), group,
                       f"llama tp={ws} sp on the batch loss_parallel={loss_parallel}", tol, device, dtype, close)
        check_plan(llama_config(heads, kv_heads), tp.plans.llama(True, sequence_dim=0), group,
                   f"llama checkpointing tp={ws} sp on the batch", tol, device, dtype, close, checkpointing=True)
        check_plan(gpt2_config(), tp.plans.gpt2(True, loss_parallel=True, sequence_dim=0), group,
                   f"gpt2 tp={ws} sp on the batch", tol, device, dtype, close)
        count += 4
    # two sequences per rank's slab (a split that mixed the rows of a slab would show here), at tp 4 too
    for config, plan in ((llama_config(heads, kv_heads), tp.plans.llama(True, sequence_dim=0)),
                         (gpt2_config(), tp.plans.gpt2(True, loss_parallel=False, sequence_dim=0))):
        name = "gpt2" if isinstance(config, transformers.GPT2Config) else "llama"
        check_plan(config, plan, group, f"{name} tp={ws} sp on a batch of {2 * ws}", max(tol, TWO_PER_RANK_TOL), device,
                   dtype, close, batch=2 * ws)
        count += 1
    return count


def check_tp_plans(rank, world_size):
    from pynccl.mesh import ParallelMesh
    world = pynccl.get_default_group()
    mesh = ParallelMesh(dp=2, tp=2)
    assert plan_checks(world, heads=8, kv_heads=4) == 11  # tp 4, 2 query heads per key/value head
    assert plan_checks(mesh.tp_group, heads=4, kv_heads=2) == 15  # tp 2
    check_plan(llama_config(8, 4), tp.plans.llama(), None, "llama, tp_group=None (the default group)")
    for group, heads, kv in ((world, 8, 4), (mesh.tp_group, 4, 2)):
        for config, plan in ((llama_config(heads, kv), tp.plans.llama(True)), (gpt2_config(), tp.plans.gpt2(True))):
            ref = build(config)
            _state_dict_checks(ref, tp.parallelize_module(copy.deepcopy(ref), group, plan), group,
                               f"{type(ref).__name__} tp={group.world_size}")
    _generic_plan_checks(world)
    _generic_plan_checks(mesh.tp_group)
    _error_checks(world)
    _error_checks(mesh.tp_group)
    _sequence_dim_checks(mesh.tp_group)
    return True


@pytest.mark.numerics
def test_tp_plans_gloo_tp2_and_tp4():
    assert run_multiprocess(check_tp_plans, 4, timeout=300) == [True] * 4


def test_unshard_tensor_inverts_shard_tensor():
    full = torch.arange(2 * 12, dtype=torch.float32).reshape(2, 12)
    for num_chunks in (1, 3):
        shards = [tp.shard_tensor(full, 1, r, 2, num_chunks) for r in range(2)]
        assert torch.equal(tp.unshard_tensor(shards, 1, num_chunks), full)
    assert torch.equal(tp.shard_tensor(full, 1, 1, 2, 3), full[:, [2, 3, 6, 7, 10, 11]])


def test_plan_patterns_match_per_dotted_atom():
    from pynccl.tensor_parallel.parallelize import _matches
    assert _matches("model.layers.*.mlp", "model.layers.3.mlp")
    assert not _matches("model.layers.*.mlp", "model.layers.3.block.mlp")
    assert _matches("", "") and not _matches("", "lm_head") and not _matches("lm_head", "")


def test_styles_take_torch_placements():
    from torch.distributed.tensor import Replicate, Shard
    style = tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    assert (style.input_layout.dim, style.output_layout.is_replicate()) == (1, True)
    with pytest.raises(ValueError, match="expected Shard\\(dim\\) or Replicate\\(\\), got 'seq'"):
        tp.RowwiseParallel(output_layouts="seq")
