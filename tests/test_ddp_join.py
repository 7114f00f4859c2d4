"""pynccl.DistributedDataParallel.join() on gloo: ranks with different numbers of batches train
inside `with ddp.join():` and end with the parameters (and buffers) torch DDP's join() gives on
the same data: SGD and AdamW, divide_by_initial_world_size True and False, several buckets
rebuilt while rank 0 has already joined, BatchNorm buffers, parameters unused on some ranks,
and torch's own comm hook. Rank 0 without any batch (its bucket order never recorded) against a
single-process reference; throw_on_early_termination. One process launch per world size."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pynccl
from pynccl.testing import run_multiprocess
from numerics import assert_within, chain_rtol, record_grad_scale, trained_atol

TINY_BUCKETS_MB = 0.0002                     # ~200 bytes: several buckets


class Net(nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if bn else None
        self.extra = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)
        self.use_extra = True

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.bn is not None:
            h = self.bn(h)
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc2(h)


def _net(bn=False):
    torch.manual_seed(0)
    return Net(bn)


def _batches(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def _opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _train_joined(model, opt, batches, grad_scale=None, **join_kwargs):
    with model.join(**join_kwargs):
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            ((model(x) - y) ** 2).mean().backward()
            if grad_scale is not None:
                record_grad_scale(model.parameters(), grad_scale)
            opt.step()


def _state(model):
    return [t.detach().clone() for t in list(model.module.parameters()) + list(model.module.buffers())]


# Against torch DDP: the same local forward/backward; the all-reduce sums ws terms in another
# order and scales before or after: (ws + 1)·eps of the terms' size, the largest local gradient
# (_recording reads it off torch's buckets: with BatchNorm normalising each rank's batch, the
# ranks' gradients of fc1 cancel, and the reduced one is smaller than its terms). Against one
# process: also the Net's reductions (8, 16, 16 wide, forward and backward), the mean over 4 × 4
# outputs and the sums over the ranks' batches (at most 3 × 4 rows).
def vs_torch_rtol(ws):
    return chain_rtol(ws + 1)


ONE_PROCESS_RTOL = chain_rtol(2 * (8 + 16 + 16), 4 * 4, 3 * 4, 3 + 1)


def _assert_trained_close(ours, ref_model, ref_opt, grad_scale, rtol, steps, what):
    """Parameters within numerics.trained_atol of the reference trained by ref_opt for `steps`."""
    got, expected = list(ours.parameters()), list(ref_model.parameters())
    assert len(got) == len(expected), what
    for i, (p, q) in enumerate(zip(got, expected)):
        assert_within(p, q, trained_atol(ref_opt, q, rtol, grad_scale.get(q), steps), f"{what}: parameter {i}")


def _recording(hook, record):
    """hook, after noting the largest |local gradient| in the bucket it is handed."""
    def recording_hook(state, bucket):
        record["local"] = max(record.get("local", 0.0), bucket.buffer().abs().max().item())
        return hook(state, bucket)
    return recording_hook


def _assert_buffers_close(ours, theirs, batches, what):
    """BatchNorm's running stats follow h = relu(fc1(x)), whose weights differ by at most their
    bound: |Δh| <= Σ_k |x_k|·Δw + Δb per element, so the mean moves by at most that and the
    variance by 2·|h|·|Δh| + |Δh|² (each an EMA of per-batch values, weights summing to <= 1)."""
    dw = (ours.fc1.weight - theirs.fc1.weight).abs().max().item()
    db = (ours.fc1.bias - theirs.fc1.bias).abs().max().item()
    dh = max(x.abs().sum(1).max().item() for x, _ in batches) * dw + db if batches else 0.0
    h = max(torch.relu(theirs.fc1(x)).abs().max().item() for x, _ in batches) if batches else 0.0
    bn_o, bn_t = ours.bn, theirs.bn
    assert_within(bn_o.running_mean, bn_t.running_mean, dh + 1e-7 * bn_t.running_mean.abs().max().item(),
                  f"{what}: running_mean")
    assert_within(bn_o.running_var, bn_t.running_var, 2 * h * dh + dh * dh + 1e-7 * bn_t.running_var.abs().max().item(),
                  f"{what}: running_var")
    assert torch.equal(bn_o.num_batches_tracked, bn_t.num_batches_tracked), what


def _check_against_torch(rank, ws, counts):
    mine = _batches(rank, counts[rank])
    cases = [  # (name, bn, opt, join kwargs, DDP kwargs, extra used on which ranks, torch hook)
        ("sgd", False, "sgd", {}, {}, None, None),
        ("adamw, divide by ranks with data", False, "adamw", dict(divide_by_initial_world_size=False), {}, None, None),
        ("sgd, BatchNorm buffers", True, "sgd", {}, {}, None, None),
        ("adamw, unused on rank 0", False, "adamw", {}, dict(find_unused_parameters=True), "not0", None),
        ("sgd, torch's allreduce_hook", False, "sgd", {}, {}, None, default_hooks.allreduce_hook),
    ]
    for name, bn, opt_name, join_kw, ddp_kw, extra, hook in cases:
        ours = pynccl.DistributedDataParallel(_net(bn), bucket_cap_mb=TINY_BUCKETS_MB, **ddp_kw)
        theirs = TorchDDP(_net(bn), **ddp_kw)
        their_opt, scale, local = _opt(opt_name, theirs.parameters()), {}, {}
        if hook is not None:
            ours.register_comm_hook(None, hook)
        if not join_kw:         # a hook of its own would make torch's join ignore divide_by_initial_world_size
            theirs.register_comm_hook(None, _recording(hook or default_hooks.allreduce_hook, local))
        elif hook is not None:
            theirs.register_comm_hook(None, hook)
        for m, opt, record in ((ours, _opt(opt_name, ours.parameters()), None), (theirs, their_opt, scale)):
            m.module.use_extra = extra is None or rank != 0
            _train_joined(m, opt, mine, grad_scale=record, **join_kw)
        scale = {p: max(g, local.get("local", 0.0)) for p, g in scale.items()}
        assert len(ours.reducer.bucketer.buckets) > 2, name
        assert ours.reducer.rebuilt == (not ddp_kw), name        # find_unused_parameters keeps the first buckets
        # Every rank ends with the last joiner's model (checked below), trained by the last joiner's
        # optimizer: compared there, with that optimizer's state and gradients.
        if counts[rank] == max(counts):
            _assert_trained_close(ours.module, theirs.module, their_opt, scale, vs_torch_rtol(ws), len(mine),
                                  f"join, {name}: vs torch DDP")
            if bn:
                _assert_buffers_close(ours.module, theirs.module, mine, f"join, {name}: vs torch DDP")
        # Every rank ends with the same model (the last joiner's), as torch's join does.
        everyone = [None] * ws
        pynccl.all_gather_object(everyone, [t.tolist() for t in _state(ours)])
        assert all(e == everyone[0] for e in everyone), f"join, {name}: ranks differ after join"
        if name == "sgd":
            plain_sgd = _state(ours)
        if name == "adamw, divide by ranks with data":
            # The divisor matters here: the same run dividing by the world size ends elsewhere.
            again = pynccl.DistributedDataParallel(_net(), bucket_cap_mb=TINY_BUCKETS_MB)
            _train_joined(again, _opt("adamw", again.parameters()), mine)
            assert max((a - b).abs().max().item() for a, b in zip(_state(again), _state(ours))) > 1e-3
    return plain_sgd


def _check_rank0_without_data(rank, ws):
    """Rank 0 has no batch: it never records a bucket order, so the rebuild broadcasts its initial
    one. Against one process: step t sums the mean-loss gradients of the ranks with a t-th batch,
    divided by the world size."""
    counts = [0] + [2 + r for r in range(1, ws)]
    ours = pynccl.DistributedDataParallel(_net(), bucket_cap_mb=TINY_BUCKETS_MB)
    _train_joined(ours, _opt("sgd", ours.parameters()), _batches(rank, counts[rank]))
    ref = _net()
    opt, scale = _opt("sgd", ref.parameters()), {}
    per_rank = [_batches(r, counts[r]) for r in range(ws)]
    for t in range(max(counts)):
        opt.zero_grad()
        loss = sum(((ref(x) - y) ** 2).mean() for b in per_rank if t < len(b) for x, y in [b[t]]) / ws
        loss.backward()
        record_grad_scale(ref.parameters(), scale)
        opt.step()
    # Every rank ends with the last joiner's model, which took all max(counts) steps.
    _assert_trained_close(ours.module, ref, opt, scale, ONE_PROCESS_RTOL, max(counts),
                          "join, rank 0 without data vs one process")


def _check_throw(rank, ws):
    ours = pynccl.DistributedDataParallel(_net(), bucket_cap_mb=TINY_BUCKETS_MB)
    with pytest.raises(RuntimeError, match="exhausted inputs"):
        _train_joined(ours, _opt("sgd", ours.parameters()), _batches(rank, 1 + 2 * (rank == ws - 1)),
                      throw_on_early_termination=True)


def _case(rank, ws):
    counts = [1, 3, 2][:ws]              # rank 0 joins first, before the others rebuild their buckets
    _check_against_torch(rank, ws, counts)
    _check_rank0_without_data(rank, ws)
    _check_throw(rank, ws)
    with pytest.raises(ValueError, match="static_graph"):
        pynccl.DistributedDataParallel(_net(), static_graph=True).join()


@pytest.mark.numerics
@pytest.mark.parametrize("ws", [2, 3])
def test_join_uneven_inputs(ws):
    run_multiprocess(_case, ws, backend="gloo", timeout=180)
