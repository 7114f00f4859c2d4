"""ZeRO stages 1-3 on NCCL: parameters after clipped optimizer steps equal a single-process run
on the same global batch, within the bounds of tests/numerics.py: fp32 (TF32 off, AdamW) and bf16
mixed precision (SGD with momentum: bf16 GEMMs on differently aligned buffers may round
differently, and Adam's normalisation would turn such noise on near-zero gradients into lr-sized
steps); stage 3 frees its units;
a backward that keeps the GPU busy (gradients arrive long after the host ran every hook)
must not change the result. World size 1 on one GPU; 2+ where there are several."""
import pytest
import torch
import torch.nn.functional as F

import pynccl
from pynccl.testing import run_multiprocess
from pynccl.zero import MixedPrecision

from numerics import chain_rtol, eps, record_grad_scale
from test_zero import GLOBAL_BATCH, GRAD_RTOL, LR, NUM_PARAMS, V, Net, assert_close, expected_state, global_batch, local

STEPS = 5


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first keeps the stream busy (~10 ms)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(20_000_000)
        return grad


class SlowNet(Net):
    def forward(self, idx, tgt):
        h = self.emb(idx)
        for b in self.blocks:
            h = _SlowBackward.apply(b(h))
        return F.cross_entropy(self.head(self.norm(h)).float().reshape(-1, V), tgt.reshape(-1))


def _net(device, slow=False):
    torch.manual_seed(0)
    return (SlowNet() if slow else Net()).to(device)


def _train(model, opt, rank, ws, device, clip=None, grad_scale=None):
    for step in range(STEPS):
        idx, tgt = (t.to(device) for t in local(global_batch(step), rank, ws))
        model(idx, tgt).backward()
        if clip is not None:
            model.clip_grad_norm_(clip) if hasattr(model, "clip_grad_norm_") else \
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if grad_scale is not None:
            record_grad_scale(model.parameters(), grad_scale)
        opt.step()
        opt.zero_grad()


def _optimizer(params, mixed):
    return torch.optim.SGD(params, lr=LR, momentum=0.9) if mixed else torch.optim.AdamW(params, lr=LR)


def _reference(device, mixed, ws):
    """Single process on the global batch (fp32), or, mixed, what MixedPrecision(bf16, fp32)
    promises: each rank's forward/backward on bf16 copies of fp32 masters, fp32 mean of the
    gradients; both clipped to 0.5. Returns test_zero.expected_state: each entry with its bound.
    Gradients, relative: fp32, Net's reduction chain (test_zero.GRAD_RTOL); mixed, a bf16 cast of
    masters that differ by rounding may land one bf16 ulp apart, and ws fp32 values are averaged in
    another order; both, the clip's norm is a sum of NUM_PARAMS squares in another order."""
    master = _net(device)
    opt = _optimizer(master.parameters(), mixed)
    scale = {}
    clip_rtol = chain_rtol(NUM_PARAMS)
    if not mixed:
        _train(master, opt, 0, 1, device, clip=0.5, grad_scale=scale)
        return expected_state(master, opt, scale, STEPS, GRAD_RTOL + clip_rtol)
    for step in range(STEPS):
        grads = []
        for r in range(ws):
            bf = _net(device).to(torch.bfloat16)
            bf.load_state_dict(master.state_dict())
            bf(*(t.to(device) for t in local(global_batch(step), r, ws))).backward()
            grads.append([q.grad.float() for q in bf.parameters()])
        for p, gs in zip(master.parameters(), zip(*grads)):
            p.grad = sum(gs) / ws
        torch.nn.utils.clip_grad_norm_(master.parameters(), 0.5)
        record_grad_scale(master.parameters(), scale)
        opt.step()
        opt.zero_grad()
    return expected_state(master, opt, scale, STEPS, eps(torch.bfloat16) + (ws + 1) * eps() + clip_rtol)


def _case(rank, ws):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = pynccl.get_device()
    assert device.type == "cuda"
    refs = {mixed: _reference(device, mixed, ws) for mixed in (False, True)}
    for mixed in (False, True):
        for stage in (1, 2, 3):
            for slow in (False, True):
                mp = MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
                model = pynccl.FullyShardedDataParallel(_net(device, slow), stage=stage, mixed_precision=mp,
                                                        bucket_cap_mb=0.0005)
                opt = _optimizer(model.parameters(), mixed)
                _train(model, opt, rank, ws, device, clip=0.5)
                sd = model.full_state_dict()
                if stage == 3:
                    assert not any(u.is_allocated for u in model.units), "stage 3 must free its units"
                assert_close(sd, refs[mixed], f"stage {stage} mixed={mixed} slow={slow}")
    return True


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@needs_gpu
def test_zero_nccl_one_gpu_equals_single_process():
    assert run_multiprocess(_case, 1, backend="nccl", start_method="spawn", timeout=600) == [True]


@pytest.mark.multigpu
@needs_2_gpus
def test_zero_nccl_multi_gpu_equals_single_process():
    ws = max(n for n in (2, 3, 4) if n <= torch.cuda.device_count() and GLOBAL_BATCH % n == 0)
    assert run_multiprocess(_case, ws, backend="nccl", start_method="spawn", timeout=600) == [True] * ws


def _conditional_case(rank, ws):
    """On NCCL: blocks skipped on some ranks (the all-gathers and reduce-scatters interleave
    differently there: no hang, on a second communicator), with the embedding and the head as
    their own units; parameters equal one process averaging each rank's own gradient (fp32)."""
    from test_zero_real_clients import _Branchy, batch, check_against
    torch.backends.cuda.matmul.allow_tf32 = False
    device = pynccl.get_device()
    skips = [lambda r: (1,) if r == 1 else (), lambda r: (0, 2), lambda r: (2,) if r % 2 == 0 else ()]
    ref = _Branchy().to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model = pynccl.FullyShardedDataParallel(_Branchy(), stage=3)
    assert len(model.units) == 5, model.units
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scale = {}
    for step, skip in enumerate(skips):
        x = batch(step).to(device)
        n = x.shape[0] // ws
        sum(ref(x[r * n:(r + 1) * n], skip(r)) for r in range(ws)).div(ws).backward()
        model(x[rank * n:(rank + 1) * n], skip(rank)).backward()
        record_grad_scale(ref.parameters(), scale)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    check_against("conditional", model.full_state_dict(), ref, ref_opt, scale, len(skips))
    return True


@pytest.mark.multigpu
@needs_2_gpus
def test_zero3_nccl_conditional_blocks():
    ws = min(4, torch.cuda.device_count())
    assert run_multiprocess(_conditional_case, ws, backend="nccl", start_method="spawn", timeout=300) == [True] * ws
