"""Models, data and helpers shared by the DDP tests (test_ddp.py): small MLPs with tied, frozen and
unused parameters, a BatchNorm net, deterministic batches, the training loop users write, and the
tolerances of comparing two trainings (tests/numerics.py: derived, not measured)."""
import contextlib
import os

import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

from numerics import assert_within, chain_rtol, record_grad_scale, trained_atol

STEPS = 5
TINY_BUCKETS_MB = 0.0002                     # ~200 bytes: several buckets even for these small models


# ----------------------------------------------------------------------------- models
class MLP(nn.Module):
    """Frozen layer, tied weights; `extra` is used on the ranks in `extra_ranks` (None: all);
    `never` (if with_never) is used nowhere unless `uses_never` is set."""

    def __init__(self, extra_ranks=None, with_never=False, checkpoint=False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.hidden = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16) if with_never else None
        self.head = nn.Linear(16, 8)
        self.tied = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.tied.weight       # one parameter, two modules
        self.extra_ranks = extra_ranks
        self.checkpoint = checkpoint
        self.rank = 0
        self.uses_never = False

    def _block(self, h):
        return torch.tanh(self.hidden(torch.relu(self.frozen(h))))

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = ckpt.checkpoint(self._block, h, use_reentrant=False) if self.checkpoint else self._block(h)
        if self.extra_ranks is None or self.rank in self.extra_ranks:
            h = h + self.extra(h)
        if self.uses_never:
            h = h + self.never(h)
        return self.out(self.tied(self.head(h)))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        # No bias before BatchNorm (as every conv-BN net): BN subtracts the batch mean, so that bias's
        # gradient is zero in exact arithmetic, i.e. rounding noise, which AdamW turns into
        # +-lr steps in a random direction: no tolerance could tell a bug from that.
        self.conv = nn.Conv1d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6 * 5, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _mlp(**kw):
    torch.manual_seed(0)
    return MLP(**kw)


def _batches(shape_x, shape_y, n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape_x, generator=g), torch.randn(*shape_y, generator=g)) for _ in range(n)]


def _opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "plain-sgd":                  # no momentum: each step is exactly -lr × this step's gradient
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


# Relative gradient differences (to each tensor's largest gradient; tests/numerics.py):
# * DDP against torch DDP: the same local forward/backward; the all-reduce sums ws terms in
#   another order (bucket layouts differ) and scales by 1/ws before or after: (ws + 1)·eps.
# * DDP against one process on the whole batch: also every reduction of the MLP (8- and 16-wide
#   layers, forward and backward: 2 × 88), the mean over the output (batch × 8 at most 8 × 8 × 4)
#   and the sum over the batch of each weight's gradient (at most 32).
def vs_torch_rtol(ws):
    return chain_rtol(ws + 1)


FULL_BATCH_RTOL = chain_rtol(2 * 88, 8 * 8 * 4, 32)


def _train(model, opt, batches, rank, ws, accumulate=1, set_to_none=None, grad_scale=None):
    """Local batch = this rank's chunk of the global batch, in `accumulate` micro-batches
    (no_sync on all but the last); ws=1 with a plain model is the full-batch reference.
    grad_scale (a dict): filled with each parameter's largest |gradient| over the steps."""
    if set_to_none is None:
        set_to_none = not getattr(model, "gradient_as_bucket_view", False)   # views: zero in place
    inner = getattr(model, "module", model)
    for x, y in batches:
        xs, ys = x.chunk(ws)[rank], y.chunk(ws)[rank]
        opt.zero_grad(set_to_none=set_to_none)
        micro = list(zip(xs.chunk(accumulate), ys.chunk(accumulate)))
        for i, (mx, my) in enumerate(micro):
            if hasattr(inner, "rank"):
                inner.rank = rank
            sync = i == len(micro) - 1 or not hasattr(model, "no_sync")
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = ((model(mx) - my) ** 2).mean() / len(micro)
                loss.backward()
        if grad_scale is not None:
            record_grad_scale(inner.parameters(), grad_scale)
        opt.step()
    return inner


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def _assert_params_close(got, expected, what, tol=1e-6):
    got, expected = list(got), list(expected)
    assert len(got) == len(expected), what
    d = _max_diff(got, expected)
    if os.environ.get("DDP_TEST_PRINT_DIFFS"):
        print(f"{what}: max |diff| {d:.3g} (tol {tol})", flush=True)
    assert d <= tol, f"{what}: max |diff| {d:.3g} > {tol}"


def _assert_trained_close(got, ref_model, ref_opt, grad_scale, rtol, what, steps=STEPS):
    """got (parameters) against ref_model's, trained by ref_opt (SGD or AdamW) for `steps` steps on
    gradients that agree to rtol of each tensor's scale: SGD moves them apart at most linearly,
    AdamW element-wise by adam_atol (its own bound where a gradient is rounding noise)."""
    got, expected = list(got), list(ref_model.parameters())
    assert len(got) == len(expected), what
    for i, (p, q) in enumerate(zip(got, expected)):
        tol = trained_atol(ref_opt, q, rtol, grad_scale.get(q), steps)
        assert_within(p, q, tol, f"{what}: parameter {i}")
