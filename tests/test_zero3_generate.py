"""Hugging Face generate() on a ZeRO-wrapped model, as FSDP2 users run it in eval loops: model.generate(...)
(the wrapper delegates to the module's) and model.module.generate(...), on every rank with the same inputs.
Each forward call inside generate gathers stage 3's root unit and blocks and releases them after
(root_calls.py), so greedy decoding returns exactly the token ids of the unwrapped model with the same
weights, with the KV cache or without, and a manual decode loop over past_key_values gives its logits
bit for bit. Nothing is left behind: a training step after generate gives the loss and parameters of the
same step without it, and every parameter attribute is a placeholder again. Stages 1/2 generate with the
shards of the last optimizer step. Tiny GPT-2 (tied embeddings, the blocks as units) and Llama (blocks,
embedding and head as units) from tests/test_zero_real_clients.py, random init; 2 gloo ranks.
"""
import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork

import pynccl
from pynccl.errors import ShardedParameterError
from pynccl.testing import run_multiprocess
from pynccl.zero.placeholder import ShardedParamPlaceholder

from test_zero import make_net
from test_zero3_outside_unit import _check
from test_zero_real_clients import VOCAB, batch, local, make_model

WS = 2
NEW_TOKENS = 8


def prompt(device="cpu"):
    """The same on every rank (generate issues one forward per token: every rank must make as many)."""
    return torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7)).to(device)


def greedy(model, x, use_cache):
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                          use_cache=use_cache, pad_token_id=0)


@torch.no_grad()
def decode_logits(module, x):
    """Greedy decoding by hand over past_key_values: the logits of every step, concatenated."""
    out = module(input_ids=x, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(NEW_TOKENS - 1):
        out = module(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=out.past_key_values,
                     use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def plain_with(model, kind, device="cpu"):
    """The unwrapped model holding `model`'s current weights (full_state_dict: collective)."""
    plain = make_model(kind).to(device)
    plain.load_state_dict(model.full_state_dict())
    return plain


def train_step(model, opt, step, rank, direct=False):
    """One AdamW step; returns the global loss. direct: through model.module, as FSDP2's root module trains."""
    x = local(batch(step), rank, WS)
    loss = (model.module if direct else model)(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().clone()
    pynccl.all_reduce(loss, op=pynccl.ReduceOp.AVG)
    return float(loss)


def all_placeholders(model):
    return all(isinstance(getattr(m, n), ShardedParamPlaceholder)
               for m in model.module.modules() for n, _ in m.named_parameters(recurse=False))


def check_generate(model, kind, device="cpu", logits_match=torch.equal):
    """wrapped.generate and wrapped.module.generate against the unwrapped model with the same weights:
    token ids with and without the cache, a decode loop's logits over past_key_values, the logits of a
    plain forward after them (through the wrapper and through model.module), compared by
    logits_match(got, expected) (bit equality by default)."""
    plain, x = plain_with(model, kind, device), prompt(device)
    for use_cache in (True, False):
        expected = greedy(plain, x, use_cache)
        assert expected.shape == (2, 6 + NEW_TOKENS), expected.shape
        for via in (model, model.module):
            got = greedy(via, x, use_cache)
            assert torch.equal(got, expected), (kind, use_cache, via is model, got, expected)
    assert logits_match(decode_logits(model.module, x), decode_logits(plain, x)), kind
    with torch.no_grad():
        expected = plain(input_ids=x).logits
        assert logits_match(model(input_ids=x).logits, expected), kind
        assert logits_match(model.module(input_ids=x).logits, expected), kind
    if model.stage == 3:
        assert all_placeholders(model), "a parameter left gathered after generate"


# ---------------------------------------------------------------------- cases
def case_stage3(rank, ws, kind):
    """Generate before training, between steps, and after; a run with generate between its steps equals
    one without, loss and parameters bit for bit (also when the step runs through model.module)."""
    model, quiet = (pynccl.FullyShardedDataParallel(make_model(kind), stage=3) for _ in range(2))
    assert len(model.units) == (4 if kind == "gpt2" else 6), len(model.units)   # + wte/lm_head or embed, head
    opt, quiet_opt = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, quiet))
    check_generate(model, kind)
    for step in range(3):
        loss = train_step(model, opt, step, rank, direct=step == 2)
        assert loss == train_step(quiet, quiet_opt, step, rank), step
        check_generate(model, kind)
    got, expected = model.full_state_dict(), quiet.full_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected), "generate changed a training step"
    with pytest.raises(ShardedParameterError):
        model.module.lm_head.weight.sum()              # outside forward, still a placeholder


def case_stages_1_2(rank, ws):
    """Full parameters on every rank: generate uses the shards of the last step (re-gathered first)."""
    for stage in (1, 2):
        model = pynccl.FullyShardedDataParallel(make_model("llama"), stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        check_generate(model, "llama")
        train_step(model, opt, 0, rank)                # model.module's tensors are stale until the next gather
        check_generate(model, "llama")


def case_blocks_only(rank, ws):
    """Llama with only its decoder layers as units: embedding, norm and head in the root."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    model = pynccl.FullyShardedDataParallel(make_model("llama"), stage=3, wrap_modules=[LlamaDecoderLayer])
    assert len(model.units) == 4
    check_generate(model, "llama")


def case_compiled(rank, ws):
    """torch.compile(wrapper) trains (the module's hooks stand aside for the wrapper's own call, traced),
    then generate on the wrapper gathers as in eager."""
    model = pynccl.FullyShardedDataParallel(make_model("gpt2"), stage=3)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(2):
        train_step(compiled, opt, step, rank)
    check_generate(model, "gpt2")


def case_uneven_lengths(rank, ws):
    """Ranks with different prompts whose generation ends after different numbers of tokens: Hugging
    Face's synced_gpus, on by default for FSDP2-managed models and so for stage 3, keeps the finished rank's
    forward calls going until every rank is done; each rank's tokens are the unwrapped model's."""
    model = pynccl.FullyShardedDataParallel(make_model("llama"), stage=3)
    plain, x = plain_with(model, "llama"), prompt()
    x = x if rank == 0 else x.flip(0)[:, 1:]           # the prompts differ between the ranks too
    for via in (model, model.module):
        n = 2 + 3 * rank
        got = via.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
        expected = plain.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  pad_token_id=0)
        assert got.shape == (2, x.shape[1] + n) and torch.equal(got, expected), (rank, got, expected)
    assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)   # the ranks are in step again


def case_no_generate(rank, ws):
    model = pynccl.FullyShardedDataParallel(make_net(), stage=3)
    with pytest.raises(AttributeError, match="Net has no generate"):
        model.generate(torch.zeros(1, 4, dtype=torch.long))


def _outcome(fn, *args):
    try:
        fn(*args)
    except Exception as e:                             # noqa: BLE001
        import traceback
        return f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    return None


def _gpt2(rank, ws):
    torch._dynamo.reset()
    return {"stage3": _outcome(case_stage3, rank, ws, "gpt2"), "compiled": _outcome(case_compiled, rank, ws),
            "no_generate": _outcome(case_no_generate, rank, ws)}


def _llama(rank, ws):
    return {"stage3": _outcome(case_stage3, rank, ws, "llama"), "stages_1_2": _outcome(case_stages_1_2, rank, ws),
            "blocks_only": _outcome(case_blocks_only, rank, ws), "uneven": _outcome(case_uneven_lengths, rank, ws)}


@pytest.fixture(scope="module")
def gpt2():
    return run_multiprocess(_gpt2, WS, timeout=240)


@pytest.fixture(scope="module")
def llama():
    return run_multiprocess(_llama, WS, timeout=240)


# ---------------------------------------------------------------------- tests
def test_gpt2_stage3_generate_equals_the_unwrapped_model_and_training_is_unchanged(gpt2):
    _check(gpt2, "stage3")


def test_generate_after_training_the_compiled_wrapper(gpt2):
    _check(gpt2, "compiled")


def test_generate_of_a_module_without_one_names_its_type(gpt2):
    _check(gpt2, "no_generate")


def test_llama_stage3_generate_equals_the_unwrapped_model_and_training_is_unchanged(llama):
    _check(llama, "stage3")


def test_llama_stage3_with_only_the_layers_as_units(llama):
    _check(llama, "blocks_only")


def test_stages_1_2_generate_with_the_last_step_weights(llama):
    _check(llama, "stages_1_2")


def test_ranks_ending_generation_at_different_lengths_stay_in_step(llama):
    _check(llama, "uneven")
