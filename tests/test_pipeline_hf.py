"""Pipeline stages cut from Hugging Face models (pynccl.pipeline.hf) against the unwrapped model.

Process-free: the stages chained in order give the model's logits and HF's own loss exactly, they
hold the model's parameters (each once), and the errors name what is wrong. On gloo at pp 2 and 4:
a tiny LlamaForCausalLM (and an untied GPT-2) trained 3 SGD steps (momentum 0.9) under GPipe, 1F1B
and interleaved 1F1B has, at every step, the whole batch's loss and every gradient of the
single-process model, and the same parameters after the steps, within the fp32 rounding of the
model's reductions (tests/numerics.py). SGD, not AdamW: the pipeline does not touch the optimizer,
and SGD's step is linear in the gradient, so a rounding difference stays a rounding difference
(AdamW's first step is lr·sign(g): a near-zero gradient whose sign flips moves 2·lr, which then
shows in every later gradient), and a wrong gradient scale shows in the parameters. A missed
1/n_microbatches scale, a dropped micro-batch, a stage fed the wrong positions or mask, or a layer
left out breaks these by orders of magnitude more than the tolerance (test_mutants_fail)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pynccl.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe,  # noqa: E402
                             ScheduleInterleaved1F1B, causal_lm_loss, hf_layer_ranges, hf_stage_module,
                             hf_stage_modules)
from pynccl.testing import MultiProcessError, run_multiprocess  # noqa: E402
from numerics import max_rel_diff, sgd_atol, transformer_rtol  # noqa: E402

VOCAB, SEQ, BATCH, MICROBATCHES, STEPS = 128, 16, 8, 4, 3
HIDDEN, FFN, HEADS, LAYERS = 64, 256, 4, 4           # GPT-2's MLP is 4 × hidden; Llama's 128 is smaller
LR, MOMENTUM = 0.5, 0.9
# The loss and each gradient (relative to its tensor's largest element): fp32 rounding of the
# model's reduction chain, computed on micro-batches of 2 against the whole batch of 8 (5.5e-4;
# measured up to 6e-5 with either CPU capability).
REL = transformer_rtol(LAYERS, HIDDEN, FFN, HIDDEN // HEADS, SEQ, VOCAB, BATCH * SEQ)


def _llama(seed=0, layers=4):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                                   num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=128,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2(seed=0, tied=False):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                                  tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _tokens(seed, batch=BATCH):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- no processes
@pytest.mark.numerics
@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("num_stages", [1, 3, 4])
def test_stages_chained_are_the_model(family, num_stages):
    model = MODELS[family]().eval()
    x = _tokens(1, batch=3)
    out = model(input_ids=x, labels=x)
    stages = [hf_stage_module(model, k, num_stages) for k in range(num_stages)]
    hidden = x
    for stage in stages:
        hidden = stage(hidden)
    assert hidden.shape == (3, SEQ, VOCAB)
    assert torch.equal(hidden, out.logits)
    assert torch.equal(causal_lm_loss(hidden, x), out.loss)
    # Each of the model's parameters sits in exactly one stage, and is the model's own tensor.
    held = [id(p) for s in stages for p in s.parameters()]
    assert len(held) == len(set(held))
    assert set(held) == {id(p) for p in model.parameters()}


def test_layer_ranges_and_interleaved_placement():
    model = _llama(layers=8)
    assert hf_layer_ranges(model, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert hf_layer_ranges(model, 3, boundaries=[1, 5]) == [(0, 1), (1, 5), (5, 8)]
    # pp 2 × 2 stages per rank: rank 1 holds stages 1 and 3 (k % pp), the last one with the head.
    s1, s3 = hf_stage_modules(model, 1, 2, stages_per_rank=2)
    assert (s1.layer_range, s3.layer_range) == ((2, 4), (6, 8))
    assert not s1.is_first and not s1.is_last and s3.is_last
    assert s3.lm_head is model.lm_head and s1.layers[0] is model.model.layers[2]
    assert not hasattr(s1, "embed_tokens") and not hasattr(s1, "lm_head")


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        hf_stage_module(_gpt2(tied=True), 0, 2)
    hf_stage_module(_gpt2(tied=True), 0, 1)          # one stage holds both ends: fine
    with pytest.raises(TypeError, match="Llama's layout"):
        hf_stage_module(torch.nn.Linear(2, 2), 0, 1)
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, num_stages=2\)"):
        hf_stage_module(_llama(), 2, 2)
    with pytest.raises(ValueError, match="cannot cut 4 layers into 5"):
        hf_stage_module(_llama(), 0, 5)
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, pp_size=2\)"):
        hf_stage_modules(_llama(), 2, 2)
    with pytest.raises(TypeError, match="takes token ids"):
        hf_stage_module(_llama(), 0, 2)(torch.randn(2, SEQ, 64))


def test_causal_lm_loss_ignores_the_last_position_and_minus_100():
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, 3, 4, 5], [6, -100, 0, 1, 2]]) % 7
    labels[1, 1] = -100
    # Token t predicts label t + 1: pairs (logits[b, t], labels[b, t + 1]), skipping -100.
    pairs = [(b, t) for b in range(2) for t in range(4) if labels[b, t + 1] != -100]
    expected = torch.stack([torch.nn.functional.cross_entropy(logits[b, t], labels[b, t + 1])
                            for b, t in pairs]).mean()
    assert torch.allclose(causal_lm_loss(logits, labels), expected, rtol=1e-6)


# ----------------------------------------------------------------------------- multi-process
def _mutated_loss(mutant):
    """causal_lm_loss with the same value but a wrong gradient: "scale" as a missed
    1/n_microbatches (n times the gradient), "drop" as a dropped micro-batch (the first one's
    gradient is zero)."""
    calls = []

    def loss_fn(logits, target):
        loss = causal_lm_loss(logits, target)
        calls.append(1)
        if mutant == "scale":
            return loss.detach() + MICROBATCHES * (loss - loss.detach())
        if mutant == "drop" and len(calls) % MICROBATCHES == 1:
            return loss.detach() + 0 * loss
        return loss
    return loss_fn if mutant else causal_lm_loss


def _train_and_compare(rank, p, family, schedule_cls, stages_per_rank, mutant=None):
    """3 SGD steps pipelined and on the whole model alone; returns the names this rank trained."""
    what = f"{family} {schedule_cls.__name__} pp={p} v={stages_per_rank} rank {rank}"
    model = MODELS[family](seed=5)
    ref = copy.deepcopy(model)
    num_stages = p * stages_per_rank
    mods = hf_stage_modules(model, rank, p, stages_per_rank)
    stages = [PipelineStage(mod, k, num_stages) for mod, k in zip(mods, range(rank, num_stages, p))]
    sched = schedule_cls(stages if stages_per_rank > 1 else stages[0], MICROBATCHES, _mutated_loss(mutant))
    owned = {id(q) for mod in mods for q in mod.parameters()}
    names = [n for n, q in model.named_parameters() if id(q) in owned]
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    opt = torch.optim.SGD([params[n] for n in names], lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    has_first, has_last = rank == 0, rank == (num_stages - 1) % p
    grad_scale = dict.fromkeys(names, 0.0)          # each tensor's largest gradient over the steps
    for step in range(STEPS):
        x = _tokens(100 + step)
        losses = []
        sched.step(*([x] if has_first else []), target=x if has_last else None, losses=losses)
        ref_loss = ref(input_ids=x, labels=x).loss
        ref_loss.backward()
        if has_last:
            assert len(losses) == MICROBATCHES, what
            d = max_rel_diff(torch.stack(losses).mean(), ref_loss.detach())
            assert d <= REL, f"{what} step {step}: loss differs from the whole batch's by {d:.1e} (relative)"
        else:
            assert losses == [], what
        for n in names:
            assert params[n].grad is not None, f"{what} step {step}: {n} has no gradient"
            d = max_rel_diff(params[n].grad, ref_params[n].grad)
            assert d <= REL, f"{what} step {step}: gradient of {n} differs by {d:.1e} (relative, bound {REL:.1e})"
            grad_scale[n] = max(grad_scale[n], ref_params[n].grad.abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # SGD moves the two runs apart by at most lr × the gradients' differences (REL of each
    # tensor's scale) summed through the momentum buffer; a skipped or stale update is off by a
    # whole step, lr × |g|, about 1/REL times more.
    for n in names:
        tol = sgd_atol(LR, STEPS, REL * grad_scale[n], MOMENTUM)
        d = (params[n].detach() - ref_params[n].detach()).abs().max().item()
        assert d <= tol, f"{what}: parameter {n} after {STEPS} steps differs by {d:.1e} > {tol:.1e}"
    untouched = [n for n, q in model.named_parameters() if id(q) not in owned and q.grad is not None]
    assert not untouched, f"{what}: parameters of other ranks' stages got gradients here: {untouched}"
    return names


def _check_pipelines(rank, p):
    cases = [("llama", ScheduleGPipe, 1), ("llama", Schedule1F1B, 1), ("gpt2", Schedule1F1B, 1)]
    if p == 2:   # 4 layers: 2 stages per rank only at pp 2
        cases += [("llama", ScheduleInterleaved1F1B, 2), ("gpt2", ScheduleGPipe, 1)]
    return {f"{family} {cls.__name__}": _train_and_compare(rank, p, family, cls, v) for family, cls, v in cases}


@pytest.mark.numerics
@pytest.mark.parametrize("p", [2, 4])
def test_hf_pipeline_trains_as_one_process(p):
    per_rank = run_multiprocess(_check_pipelines, world_size=p, timeout=240)
    for case in per_rank[0]:
        family = case.split()[0]
        all_names = [n for n, _ in MODELS[family]().named_parameters()]
        held = [n for r in range(p) for n in per_rank[r][case]]
        assert sorted(held) == sorted(all_names), f"{case}: each parameter must be trained by exactly one rank"


def _check_mutant(rank, p, mutant):
    _train_and_compare(rank, p, "llama", Schedule1F1B, 1, mutant)


@pytest.mark.parametrize("mutant", ["scale", "drop"])
def test_mutants_fail(mutant):
    """The tolerances above catch what they guard: a missed 1/n_microbatches and a dropped
    micro-batch's gradient (the loss's value unchanged) fail the gradient check."""
    with pytest.raises(MultiProcessError, match="gradient of .* differs by"):
        run_multiprocess(_check_mutant, world_size=2, timeout=240, args=(mutant,))
