"""pynccl.DistributedDataParallel against torch DDP in the same ranks, on gloo, where the two once
diverged: the parameters and buffers torch is told to ignore, torch's fp16 / bf16 compress wrappers
(GradBucket.set_buffer), static_graph with a parameter used outside forward, two forwards before
one backward, or one block run twice under reentrant checkpoints, reentrant checkpoints before the
end of backward (tied embeddings, the output made in one), and sparse gradients (refused at
construction, naming the parameter).

NOTE: two ranks, so averaging is exact: halving is exact in binary floating point, and both DDPs sum
the same two fp32 values (round(a + b) / 2 == round(a / 2 + b / 2)); gradients are compared bit for bit."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pynccl
from pynccl.testing import run_multiprocess

WORLD = 2


def _both(make, **kw):
    """(pynccl DDP, torch DDP) over two copies of the same model."""
    torch.manual_seed(0)
    ours = pynccl.DistributedDataParallel(make(), **kw)
    torch.manual_seed(0)
    theirs = TorchDDP(make(), **kw)
    return ours, theirs


def _assert_same_grads(ours, theirs, what):
    mine, torchs = dict(ours.module.named_parameters()), dict(theirs.module.named_parameters())
    for name, q in torchs.items():
        p = mine[name]
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}: grad None-ness differs from torch DDP"
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{what}: {name}: grad {p.grad} vs torch DDP's {q.grad}"


# ----------------------------------------------------------------------------- ignored params and buffers

class _Ignoring(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(2, 1, bias=False)          # ignored
        self.b = nn.Parameter(torch.zeros(1))
        self.register_buffer("kept", torch.full((2,), float(rank + 1)))
        self.register_buffer("own", torch.full((2,), float(rank + 1)))   # ignored
        with torch.no_grad():
            self.lin.weight.fill_(float(rank + 1))
            self.b.fill_(float(rank + 1))

    def forward(self, x):
        return self.lin(x).sum() * self.b.sum() + (self.kept * self.own).sum()


class _TiedLM(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight              # tied: pynccl's tied_embedding_rows path applies
        with torch.no_grad():
            self.emb.weight.fill_(0.25 * (rank + 1))

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _check_ignored(rank, ws):
    for make, ignore, x in ((_Ignoring, ["lin.weight", "own"], torch.full((1, 2), float(rank + 1))),
                            (_TiedLM, ["emb.weight", "head.weight"], torch.tensor([[rank, 3, 5]]))):
        sides = {}
        for name, ddp in (("ours", pynccl.DistributedDataParallel), ("torch", TorchDDP)):
            torch.manual_seed(0)
            m = make(rank)
            TorchDDP._set_params_and_buffers_to_ignore_for_model(m, ignore)
            d = ddp(m)
            state = {n: t.detach().clone() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
            for _ in range(2):                          # the buffers are broadcast at each forward
                d.zero_grad(set_to_none=True)
                d(x).pow(2).sum().backward()
            grads = {n: p.grad.clone() for n, p in m.named_parameters()}
            buffers = {n: t.clone() for n, t in m.named_buffers()}
            sides[name] = (state, grads, buffers)
        for (n, a), b in zip(sides["ours"][0].items(), sides["torch"][0].values()):
            assert torch.equal(a, b), f"{make.__name__}: {n} after construction: {a} vs torch DDP's {b}"
        for k, what in ((1, "grad"), (2, "buffer after forward")):
            for (n, a), b in zip(sides["ours"][k].items(), sides["torch"][k].values()):
                assert torch.equal(a, b), f"{make.__name__}: {n} {what}: {a} vs torch DDP's {b}"
    # the ignored ones are this rank's own (the check above would pass if both DDPs ignored nothing)
    own = sides["ours"]
    assert own[0]["emb.weight"].flatten()[0].item() == 0.25 * (rank + 1)


def test_ignored_params_and_buffers_match_torch():
    run_multiprocess(_check_ignored, WORLD, backend="gloo", timeout=120)


# ----------------------------------------------------------------------------- compress wrappers

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _check_compress_wrappers(rank, ws):
    for wrap in (default_hooks.fp16_compress_wrapper, default_hooks.bf16_compress_wrapper):
        for view in (False, True):
            ours, theirs = _both(_Net, bucket_cap_mb=0.0005, gradient_as_bucket_view=view)   # several buckets
            for d in (ours, theirs):
                d.register_comm_hook(None, wrap(default_hooks.allreduce_hook))
            g = torch.Generator().manual_seed(rank)
            for step in range(3):                       # a bucket swapped by set_buffer must not stick
                x = torch.randn(4, 8, generator=g)
                for d in (ours, theirs):
                    d.zero_grad(set_to_none=True)
                    d(x).pow(2).sum().backward()
                _assert_same_grads(ours, theirs, f"{wrap.__name__} view={view} step {step}")
                with torch.no_grad():
                    for d in (ours, theirs):
                        for p in d.parameters():
                            p.sub_(0.1 * p.grad)


def test_compress_wrappers_match_torch():
    run_multiprocess(_check_compress_wrappers, WORLD, backend="gloo", timeout=120)


# ----------------------------------------------------------------------------- static_graph

class _Temp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.temp = nn.Parameter(torch.tensor(2.0))     # used in the loss, outside forward

    def forward(self, x):
        return self.a(x)


class _TwoPaths(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.never = nn.Linear(4, 4)                    # unused everywhere: grad stays None, as in torch

    def forward(self, x, use_b):
        h = torch.relu(self.a(x))
        return self.c(self.b(h) if use_b else h)


class _SharedCheckpointed(nn.Module):
    """One block applied twice, each under a reentrant checkpoint: its parameters' gradient hooks
    fire once per application (each recomputation runs its own backward), which torch's static_graph
    counts in the first iteration and waits for after."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        return self.out(h)


def _check_static_graph(rank, ws):
    losses = {"outside forward": (_Temp, lambda d, x: d(x).sum() * d.module.temp),
              "two forwards": (_TwoPaths, lambda d, x: d(x, True).sum() + d(x, False).sum()),
              "a block twice under reentrant checkpoints": (_SharedCheckpointed, lambda d, x: d(x).sum())}
    for what, (make, loss) in losses.items():
        for view in (False, True):
            ours, theirs = _both(make, static_graph=True, gradient_as_bucket_view=view)
            g = torch.Generator().manual_seed(rank)
            for step in range(3):
                x = torch.randn(3, 4, generator=g)
                for d in (ours, theirs):
                    d.zero_grad(set_to_none=True)
                    loss(d, x).backward()
                _assert_same_grads(ours, theirs, f"static_graph, {what}, view={view}, step {step}")


def test_static_graph_learns_from_first_backward_like_torch():
    run_multiprocess(_check_static_graph, WORLD, backend="gloo", timeout=120)


# ----------------------------------------------------------------------------- reentrant checkpoints
# A hook inside a reentrant checkpoint fires in that checkpoint's own backward, which ends before the
# outer one: the end of the reduction must wait for the outer backward (torch's _DDPSink), or a
# gradient computed after the checkpoint is left out of it.

def _reentrant(f, h):
    return torch.utils.checkpoint.checkpoint(f, h, use_reentrant=True)


class _EndCheckpointed(nn.Module):
    """The output comes from a reentrant checkpoint: every hook of the first backward fires inside one."""

    def __init__(self):
        super().__init__()
        self.inp, self.block = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = _reentrant(lambda t: torch.tanh(self.block(t)), h)
        return h


class _TiedCheckpointed(nn.Module):
    """An LM head tied to its embedding (tied_embedding_rows acts: on by default) and a reentrant
    checkpoint: around the block between them ("block"), around that block with the tied weight
    also read inside it ("functional"), or around the head ("head")."""

    def __init__(self, where="block"):
        super().__init__()
        self.where = where
        self.emb, self.mid, self.head = nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        if self.where == "head":
            return _reentrant(self.head, torch.tanh(self.mid(self.emb(ids))))
        extra = (lambda t: t @ self.emb.weight[:4]) if self.where == "functional" else (lambda t: 0)
        return self.head(_reentrant(lambda t: torch.tanh(self.mid(t) + extra(t)), self.emb(ids)))


def _check_reentrant(rank, ws):
    from numerics import assert_within, chain_rtol
    cases = [("output from a checkpoint", _EndCheckpointed, {"static_graph": True},
              lambda g: torch.randn(3, 4, generator=g)),
             ("tied LM", _TiedCheckpointed, {}, None), ("tied LM", _TiedCheckpointed, {"static_graph": True}, None),
             ("tied weight read in the checkpoint", lambda: _TiedCheckpointed("functional"), {"static_graph": True},
              None),
             ("tied head in the checkpoint", lambda: _TiedCheckpointed("head"), {"static_graph": True}, None)]
    for what, make, kw, inputs in cases:
        inputs = inputs or (lambda g: torch.randint(0, 6, (2, 3), generator=g))
        for view in (False, True):
            ours, theirs = _both(make, gradient_as_bucket_view=view, **kw)
            g = torch.Generator().manual_seed(rank)
            for step in range(3):
                x = inputs(g)
                for d in (ours, theirs):
                    d.zero_grad(set_to_none=True)
                    d(x).sum().backward()
                label = f"{what}, {kw}, view={view}, step {step}"
                if make is _EndCheckpointed:
                    _assert_same_grads(ours, theirs, label)
                    continue
                # NOTE: the tied rows add the lookup's rows apart from the head's part: the tied gradient is
                # each element's sum of ws * 6 token terms and the head's in another order than torch's
                rtol = chain_rtol(ws * 6 + ws + 1)
                for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
                    assert_within(p.grad, q.grad, rtol * q.grad.abs().max().item(), f"{label}: grad of {name}")
    # without static_graph a parameter whose hook fires twice (in and after the checkpoint) is refused,
    # not reduced in part: at once for the head in it; for the weight read in it once the tied rows
    # step aside (after the first step, whose tied gradient misses that read: see training.md)
    for where, steps in (("head", 1), ("functional", 3)):
        ours = pynccl.DistributedDataParallel(_TiedCheckpointed(where))
        with pytest.raises(RuntimeError, match="ready only once per backward.*static_graph=True"):
            for _ in range(steps):
                ours.zero_grad(set_to_none=True)
                ours(torch.randint(0, 6, (2, 3))).sum().backward()


@pytest.mark.numerics
def test_reentrant_checkpoints_reduce_after_the_outer_backward_like_torch():
    run_multiprocess(_check_reentrant, WORLD, backend="gloo", timeout=180)


# ----------------------------------------------------------------------------- sparse gradients

class _SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.e = nn.Embedding(10, 4, sparse=True)

    def forward(self, x, ids):
        return self.a(x) + self.e(ids).sum(1)


def _check_sparse_refused(rank, ws):
    with pytest.raises(ValueError, match=r"parameter 'e\.weight' gets sparse gradients.*does not support"):
        pynccl.DistributedDataParallel(_SparseNet())
    model = _SparseNet()
    model.e.weight.requires_grad_(False)                # frozen: no gradient at all, nothing to refuse
    pynccl.DistributedDataParallel(model)


def test_sparse_gradients_refused_at_construction():
    run_multiprocess(_check_sparse_refused, WORLD, backend="gloo", timeout=120)
