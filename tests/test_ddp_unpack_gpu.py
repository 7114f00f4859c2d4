"""Issue 26's early unpack (reducer.unpack_early, csrc/bucket_reduce.cpp): each bucket's reduced
gradients are written into .grad on a side stream as soon as its all-reduce ends, instead of at
the end of backward. Exact, so compared bit for bit: against torch DDP with SGD at world size 2
(a sum of two fp32 terms, and a power-of-two scale, round the same in any order; at world size
1 there is no sum), and against
pynccl's own end-of-backward write-back with SGD and AdamW at any world size (the same
reduction, only the copy moves). Also: that the copy really happens before backward's end,
that the cases where it may not (find_unused with a parameter unused here) fall back, the
pipelined last bucket (tail_chunks), and join()."""
import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pynccl
from pynccl.testing import run_multiprocess

BUCKET_MB = 0.05            # several buckets for this model
STEPS = 4


class _Probe(torch.autograd.Function):
    """Identity whose backward (it runs before the embedding's, i.e. after every other bucket
    was handed out) calls `on_backward` once the device has finished all work queued so far."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_backward is not None:
            torch.cuda.synchronize()
            ctx.on_backward()
        return grad, None


class Net(nn.Module):
    def __init__(self, with_unused=False):
        super().__init__()
        self.embed = nn.Linear(32, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 256), nn.GELU(),
                                                  nn.Linear(256, 128)) for _ in range(3))
        self.unused = nn.Linear(128, 128) if with_unused else None
        self.head = nn.Linear(128, 16)
        self.on_backward = None

    def forward(self, x):
        h = _Probe.apply(self.embed(x), self.on_backward)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(h)


def _build(device, wrap, opt_name, with_unused=False):
    torch.manual_seed(0)
    model = wrap(Net(with_unused).to(device))
    if opt_name == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _data(rank, ws, device):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS + 1):
        x, y = torch.randn(8 * ws, 32, generator=g), torch.randn(8 * ws, 16, generator=g)
        out.append((x.chunk(ws)[rank].to(device), y.chunk(ws)[rank].to(device)))
    return out


def _train(model, opt, data, set_to_none, accumulate):
    """STEPS steps; with `accumulate`, each step's backward follows one no_sync backward."""
    for i in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        if accumulate:
            with model.no_sync():
                ((model(data[i + 1][0]) - data[i + 1][1]) ** 2).mean().backward()
        ((model(data[i][0]) - data[i][1]) ** 2).mean().backward()
        opt.step()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.module.parameters()], \
        [None if p.grad is None else p.grad.detach().clone() for p in model.module.parameters()]


def _ours(device, early, tail_chunks=1, **kw):
    kw.setdefault("gradient_as_bucket_view", False)       # NOTE: unpacking is of copies; the default is views

    def wrap(m):
        d = pynccl.DistributedDataParallel(m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB, **kw)
        d.reducer.unpack_early = early
        d.reducer.tail_chunks = tail_chunks
        assert d.reducer.fused_comm is not None and len(d.reducer.bucketer.buckets) > 2
        return d
    return wrap


def _early_unpack_is_exact(rank, ws):
    device = pynccl.get_device()
    torch_pg = tdist.new_group(backend="nccl")
    data = _data(rank, ws, device)
    failures, compared = [], 0

    def check(what, got, want):
        nonlocal compared
        compared += 1
        for kind, xs, ys in (("parameter", got[0], want[0]), ("grad", got[1], want[1])):
            bad = [i for i, (x, y) in enumerate(zip(xs, ys)) if not torch.equal(x, y)]
            if bad:
                failures.append(f"{what}: {kind}s {bad} differ (max |diff| "
                                f"{max((xs[i] - ys[i]).abs().max().item() for i in bad):.3g})")

    for comm_path in ("default", "symmetric", "copy_engine") if ws > 1 else ("default",):
        for set_to_none in (True, False):
            for accumulate in (False, True):
                for opt_name, tail in (("sgd", 1), ("adamw", 3)):
                    what = f"{comm_path} set_to_none={set_to_none} no_sync={accumulate} {opt_name} tail_chunks={tail}"
                    early = _train(*_build(device, _ours(device, True, tail, comm_path=comm_path), opt_name), data,
                                   set_to_none, accumulate)
                    late = _train(*_build(device, _ours(device, False, comm_path=comm_path), opt_name), data,
                                  set_to_none, accumulate)
                    check(f"{what}: early vs late", early, late)
                    if ws <= 2 and opt_name == "sgd":
                        theirs = _train(*_build(device, lambda m: TorchDDP(
                            m, device_ids=[device.index], process_group=torch_pg, bucket_cap_mb=BUCKET_MB), "sgd"),
                            data, set_to_none, accumulate)
                        check(f"{what}: early vs torch DDP", early, theirs)
    assert not failures, f"rank {rank}/{ws}: {len(failures)} of {compared} comparisons not bit-equal:\n" + \
        "\n".join(failures)
    return compared


def _unpack_happens_in_backward(rank, ws):
    """head.weight's bucket is handed out first; by the time _Probe's backward runs (before the
    embedding's) and the device is idle, its .grad holds the reduced value with unpack_early and
    still the local one without (the control: this rank's data differs from the other's)."""
    device = pynccl.get_device()
    x, y = _data(rank, ws, device)[0]
    seen = {}
    for early in (True, False):
        model, opt = _build(device, _ours(device, early), "sgd")
        for step in range(2):                          # the second step runs on the rebuilt buckets
            opt.zero_grad(set_to_none=True)
            head = model.module.head.weight
            model.module.on_backward = lambda: seen.__setitem__(early, head.grad.clone())
            ((model(x) - y) ** 2).mean().backward()
        torch.cuda.synchronize()
        final = head.grad
        assert torch.equal(seen[early], final) == early, \
            f"unpack_early={early}: head.weight.grad during backward " \
            f"{'differs from' if early else 'already equals'} its value after backward"
    return True


def _fallback_where_unused(rank, ws):
    """find_unused_parameters with a module no rank uses: its bucket is written back at the end
    (its parameters keep grad None, as torch's), every other bucket early; equal to torch DDP."""
    device = pynccl.get_device()
    torch_pg = tdist.new_group(backend="nccl")
    data = _data(rank, ws, device)
    ours, opt_ours = _build(device, _ours(device, True, find_unused_parameters=True), "sgd", with_unused=True)
    theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                           bucket_cap_mb=BUCKET_MB, find_unused_parameters=True),
                                "sgd", with_unused=True)
    decided = []
    decide = ours.reducer._unpacks_early
    ours.reducer._unpacks_early = lambda b: decided.append((b, decide(b))) or decided[-1][1]
    got, want = _train(ours, opt_ours, data, True, False), _train(theirs, opt_theirs, data, True, False)
    unused = {id(p) for p in ours.module.unused.parameters()}
    assert decided and all(early == unused.isdisjoint(map(id, b.params)) for b, early in decided), \
        [(b.index, early) for b, early in decided]
    assert any(early for _, early in decided) and not all(early for _, early in decided)
    for p in ours.module.unused.parameters():
        assert p.grad is None
    for i, (x, y) in enumerate(zip(got[0], want[0])):
        assert torch.equal(x, y), f"parameter {i}"
    for i, (x, y) in enumerate(zip(got[1], want[1])):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"gradient {i}"
    return True


def _join_with_early_unpack(rank, ws):
    """Uneven inputs (rank r has r + 1 batches) under `join()`: the joined rank's reduce_zeros
    must make the NCCL calls the training ranks' fused calls make (split on copy_engine, the last
    bucket in slices), or the ranks hang or sum the wrong bytes. Bit-equal to torch DDP's join."""
    device = pynccl.get_device()
    torch_pg = tdist.new_group(backend="nccl")
    data = _data(rank, ws, device)[:rank + 1]
    for comm_path in ("default", "symmetric", "copy_engine"):
        ours, opt_ours = _build(device, _ours(device, True, 3, comm_path=comm_path), "sgd")
        theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                               bucket_cap_mb=BUCKET_MB), "sgd")
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            with model.join():
                for x, y in data:
                    opt.zero_grad(set_to_none=True)
                    ((model(x) - y) ** 2).mean().backward()
                    opt.step()
        torch.cuda.synchronize()
        for i, (p, q) in enumerate(zip(ours.module.parameters(), theirs.module.parameters())):
            assert torch.equal(p, q), f"{comm_path}: parameter {i} differs from torch DDP's join"
    return True


def _every_check(rank, ws):
    """One process launch (NCCL start-up costs seconds) for every world-size-2 check."""
    return [_early_unpack_is_exact(rank, ws), _unpack_happens_in_backward(rank, ws), _fallback_where_unused(rank, ws),
            _join_with_early_unpack(rank, ws)]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_early_unpack_on_two_gpus():
    """Bit-equal to torch DDP and to the late unpack; written before backward ends; the fallback
    for unused parameters; join()."""
    per_rank = run_multiprocess(_every_check, 2, backend="nccl", start_method="spawn", timeout=300)
    assert all(r[1:] == [True, True, True] and r[0] > 0 for r in per_rank), per_rank


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_early_unpack_world_size_1():
    assert all(run_multiprocess(_early_unpack_is_exact, 1, backend="nccl", start_method="spawn", timeout=300))
