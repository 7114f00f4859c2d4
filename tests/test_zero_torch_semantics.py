"""ZeRO stages 1-3 keep torch's semantics where a training script steps outside the plain
forward / backward / step loop, each case against the unwrapped model trained in one process on
the full batch (or torch's own result):
  * load_state_dict / load_full_state_dict with strict=False load every key present, and report
    missing and unexpected keys as torch does (fine-tuning with a new head);
  * stage 3: a block applied twice under reentrant activation checkpointing gets both uses' gradient;
  * two backward passes on one forward (retain_graph) both count, and nothing leaks into the next step;
  * requires_grad changed after wrapping is an error at the next forward, not silently ignored;
  * parameters written outside an optimizer step (EMA weights swapped in and back) are re-gathered;
  * ShardedGradScaler: every rank skips the step when one rank's shard overflows.

One 2-rank run does every case (process start costs seconds); each case's outcome is a test.
Tolerances: SGD on gradients that agree to fp32 reduction order (tests/numerics.py); the bugs
guarded are >= 1e-2 off.
"""
import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

import pynccl
from pynccl.testing import run_multiprocess
from numerics import assert_within, chain_rtol, record_grad_scale, trained_atol

D, BATCH, LR, WS = 8, 8, 0.1, 2
# Gradients, relative: forward emb 4, three blocks of 8, head 8; backward as long; the loss's
# mean over 24 outputs; each weight gradient's sum over the batch of 8.
GRAD_RTOL = chain_rtol(2 * (4 + 3 * D + D), 2 * 3 * BATCH, 2 * BATCH)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


class ReentrantReuse(MLP):
    """blocks[0] applied twice (weight sharing), every use under reentrant checkpointing."""

    def forward(self, x):
        h = self.emb(x)
        for b in (self.blocks[0], self.blocks[1], self.blocks[0], self.blocks[2]):
            h = h + checkpoint.checkpoint(b, h, use_reentrant=True)
        return self.head(h)


def make(cls=MLP):
    torch.manual_seed(0)
    return cls()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 3, generator=g)


def local(t, rank):
    n = t.shape[0] // WS
    return t[rank * n:(rank + 1) * n]


# ---------------------------------------------------------------------- training loops
def one_loss(model, x, y):
    F.mse_loss(model(x), y).backward()


def two_losses(model, x, y):
    out = model(x)
    F.mse_loss(out, y).backward(retain_graph=True)
    out.pow(2).mean().backward()


def ema_swap(model, x, state):
    """After a step: torch_ema's update / copy_to / evaluation / restore, written out."""
    params = list(model.parameters())
    with torch.no_grad():
        ema = state.setdefault("ema", [p.detach().clone() for p in params])
        for e, p in zip(ema, params):
            e.mul_(0.5).add_(p, alpha=0.5)
        stored = [p.detach().clone() for p in params]
        for p, e in zip(params, ema):
            p.copy_(e)
        model(x)                                       # an evaluation forward with the EMA weights
        for p, s in zip(params, stored):
            p.copy_(s)


def train(model, rank, ws, loop, steps, after_step=None):
    """SGD steps of `loop` on this rank's part of each batch, after_step(model, x, state) after
    each; the optimizer and the gradient scales seen (for the bounds)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grad_scale, state = {}, {}
    for s in range(steps):
        x, y = batch(s)
        if ws > 1:
            x, y = local(x, rank), local(y, rank)
        loop(model, x, y)
        if ws == 1:                                    # the reference's, for the bounds
            record_grad_scale(model.parameters(), grad_scale)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model, x, state)
    return opt, grad_scale


def compare_with_plain(rank, cls, loop, stage, steps, after_step=None):
    ref = make(cls)
    ref_opt, scale = train(ref, 0, 1, loop, steps, after_step)
    model = pynccl.FullyShardedDataParallel(make(cls), stage=stage)
    train(model, rank, WS, loop, steps, after_step)
    full = model.full_state_dict()
    for name, p in ref.named_parameters():
        atol = trained_atol(ref_opt, p, GRAD_RTOL, scale.get(p), steps)
        assert_within(full[name], p, atol, f"stage {stage} {name}")


# ---------------------------------------------------------------------- cases
def case_load_non_strict(rank, stage):
    torch.manual_seed(123)
    pretrained = {k: torch.randn_like(v) for k, v in make().state_dict().items()}
    partial = {k: v for k, v in pretrained.items() if not k.startswith("head.")}   # a new head
    partial["extra.weight"] = torch.zeros(1)
    plain = make()
    expected = plain.load_state_dict(partial, strict=False)
    for api in ("load_state_dict", "load_full_state_dict"):
        net = make()                                   # stage 3: emb shares the root unit with the new head
        model = pynccl.FullyShardedDataParallel(net, stage=stage, **({"wrap_modules": list(net.blocks)}
                                                                      if stage == 3 else {}))
        if api == "load_state_dict":
            got = model.load_state_dict(partial, strict=False)
            assert (got.missing_keys, got.unexpected_keys) == (expected.missing_keys, expected.unexpected_keys), \
                f"{api}: reported {got}, torch {expected}"
        else:
            model.load_full_state_dict(partial, strict=False)
        full = model.full_state_dict()
        for k, v in plain.state_dict().items():
            assert torch.equal(full[k], v), f"stage {stage} {api}: '{k}' differs from torch's non-strict load"
        x = batch(0)[0]
        assert torch.equal(model(x), plain(x)), f"stage {stage} {api}: forward differs after the load"


def case_requires_grad_after_wrapping(rank, stage):
    for freeze_before, toggle_to in ((False, False), (True, True)):
        net = make()
        for p in net.blocks[0].parameters():
            p.requires_grad_(not freeze_before)
        model = pynccl.FullyShardedDataParallel(net, stage=stage)
        x, y = batch(0)
        one_loss(model, local(x, rank), local(y, rank))
        for p in model.module.blocks[0].parameters():
            p.requires_grad_(toggle_to)
        with torch.no_grad():
            model(local(x, rank))                      # evaluation: requires_grad does not matter
        try:
            model(local(x, rank))
        except RuntimeError as e:
            assert "requires_grad" in str(e) and "before wrapping" in str(e), str(e)
        else:
            raise AssertionError(f"stage {stage}: requires_grad set to {toggle_to} after wrapping was ignored")


class Overflow(MLP):
    """head.bias[0]'s gradient is inf once scaled by 2**30; the other elements stay finite."""

    def forward(self, x):
        return super().forward(x), (self.head.bias * torch.tensor([1e31, 0.0, 0.0])).sum()


def case_sharded_grad_scaler(rank, stage):
    def step(model, x, y, scaler):
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        out, extra = model(x)
        scaler.scale(F.mse_loss(out, y) + extra).backward()
        scaler.step(opt)
        scaler.update()
        return scaler.get_scale()

    x, y = batch(0)
    ref = make(Overflow)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_scale = step(ref, x, y, torch.amp.GradScaler("cpu", init_scale=2.0 ** 30))
    model = pynccl.FullyShardedDataParallel(make(Overflow), stage=stage)
    scale = step(model, local(x, rank), local(y, rank), pynccl.ShardedGradScaler("cpu", init_scale=2.0 ** 30))
    full = model.full_state_dict()                     # collective: before any assert, on every rank
    assert scale == ref_scale, f"stage {stage} rank {rank}: scale {scale}, torch's {ref_scale}"
    for k, v in before.items():                        # the step was skipped, as torch's
        assert torch.equal(full[k], v), f"stage {stage} rank {rank}: '{k}' changed in a step torch skips"


def _cases(rank, ws):
    outcome = {}

    def run(key, fn, *args):
        try:
            fn(*args)
            outcome[key] = None
        except Exception as e:                         # noqa: BLE001  reported by the test of this case
            outcome[key] = f"{type(e).__name__}: {e}"

    for stage in (1, 2, 3):
        run(f"load_non_strict-{stage}", case_load_non_strict, rank, stage)
        run(f"two_losses-{stage}", compare_with_plain, rank, MLP, two_losses, stage, 2)
        run(f"ema_swap-{stage}", compare_with_plain, rank, MLP, one_loss, stage, 3, ema_swap)
        run(f"requires_grad-{stage}", case_requires_grad_after_wrapping, rank, stage)
        run(f"grad_scaler-{stage}", case_sharded_grad_scaler, rank, stage)
    run("reentrant_reuse-3", compare_with_plain, rank, ReentrantReuse, one_loss, 3, 2)
    return outcome


@pytest.fixture(scope="module")
def outcomes():
    return run_multiprocess(_cases, WS, timeout=240)


def _check(outcomes, key):
    for rank, outcome in enumerate(outcomes):
        assert outcome[key] is None, f"rank {rank}: {outcome[key]}"


STAGES = (1, 2, 3)


@pytest.mark.parametrize("stage", STAGES)
def test_non_strict_load_loads_every_present_key(outcomes, stage):
    _check(outcomes, f"load_non_strict-{stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_two_backwards_on_one_forward_both_count(outcomes, stage):
    _check(outcomes, f"two_losses-{stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_written_outside_a_step_are_regathered(outcomes, stage):
    _check(outcomes, f"ema_swap-{stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_requires_grad_changed_after_wrapping_raises(outcomes, stage):
    _check(outcomes, f"requires_grad-{stage}")


@pytest.mark.parametrize("stage", STAGES)
def test_sharded_grad_scaler_skips_on_every_rank(outcomes, stage):
    _check(outcomes, f"grad_scaler-{stage}")


def test_stage3_block_reused_under_reentrant_checkpointing(outcomes):
    _check(outcomes, "reentrant_reuse-3")
