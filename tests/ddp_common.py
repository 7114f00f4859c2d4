"""Models, data and helpers shared by the DDP tests (test_ddp.py): small MLPs with tied, frozen and
unused parameters, a BatchNorm net, deterministic batches, and the training loop users write."""
import contextlib
import os

import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

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
        self.conv = nn.Conv1d(3, 6, 3, padding=1)
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
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _train(model, opt, batches, rank, ws, accumulate=1, set_to_none=None):
    """Local batch = this rank's chunk of the global batch, in `accumulate` micro-batches
    (no_sync on all but the last); ws=1 with a plain model is the full-batch reference."""
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
