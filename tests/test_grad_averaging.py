"""Every data-parallel path averages each gradient over the ranks exactly once, and computes the
next step's gradients at the parameters the last step wrote: after one backward the gradients, and
after three plain-SGD steps the parameters, equal a single process's (torch alone) on the whole
batch. Plain SGD because its update is proportional to the gradient: a missed or doubled 1/N, a
bucket left unreduced, or a forward on stale parameters shows in the first step, where AdamW's
normalised update would hide a constant factor.

Paths: DDP's bucketed reduction (many buckets; gradients copied out, or bucket views) and ZeRO
stages 1, 2 and 3, at 2 and 3 gloo ranks (3: uneven shards). Tolerance: fp32 sums of at most 16
products, in another order than one process's: a few ulps, far below a factor 2 (or 1/2) of one
SGD step of lr 0.5 on gradients of order 0.1.
"""
import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: once, before the ranks fork
import torch.nn as nn

import pynccl
from pynccl.testing import run_multiprocess

LR, STEPS, LOCAL_BATCH = 0.5, 3, 4
TOL = dict(rtol=1e-5, atol=1e-6)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step, ws):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(LOCAL_BATCH * ws, 8, generator=g), torch.randn(LOCAL_BATCH * ws, 4, generator=g)


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)   # the mean over the batch: the ranks' mean is the whole's


def _reference(ws):
    """(gradients of the first step, state after each step) of one process on the whole batch."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    first_grads, states = None, []
    for step in range(STEPS):
        _loss(model, *_batch(step, ws)).backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return first_grads, states


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _train(wrapped, rank, ws, full_state, first_grads, what):
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for step in range(STEPS):
        x, y = _batch(step, ws)
        _loss(wrapped, x[local], y[local]).backward()
        if step == 0 and first_grads is not None:
            for name, p in wrapped.module.named_parameters():
                _close(p.grad, first_grads[name], f"{what}: gradient of {name} after one backward")
        opt.step()
        opt.zero_grad()
        yield step, full_state()


def check_paths(rank, ws):
    first_grads, states = _reference(ws)
    ddp_configs = [dict(gradient_as_bucket_view=False), dict()]      # copies (torch's default), views (pynccl's)
    for kw in ddp_configs:
        ddp = pynccl.DistributedDataParallel(_model(), bucket_cap_mb=0.0004, **kw)  # ~400 B: several buckets
        assert len(ddp.reducer.bucketer.buckets) >= 3, ddp.reducer.bucketer.buckets
        for step, state in _train(ddp, rank, ws, ddp.module.state_dict, first_grads, f"DDP {kw}"):
            for k, v in states[step].items():
                _close(state[k], v, f"DDP {kw}: {k} after step {step + 1}")
    for stage in (1, 2, 3):
        zero = pynccl.FullyShardedDataParallel(_model(), stage=stage)
        # ZeRO's .grad are this rank's rows: the first-step check is the parameters after it.
        for step, state in _train(zero, rank, ws, zero.full_state_dict, None, f"ZeRO-{stage}"):
            for k, v in states[step].items():
                _close(state[k], v, f"ZeRO-{stage}: {k} after step {step + 1}")
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_data_parallel_path_averages_once(world_size):
    assert run_multiprocess(check_paths, world_size, timeout=120) == [True] * world_size
