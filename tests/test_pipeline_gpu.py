"""Pipeline parallelism on NCCL: p = 1 on one GPU (no messages: NCCL cannot send to itself), and
p = 2 on two GPUs, against a single-process reference on the same GPU. Also checks that the
step never synchronises the host with the GPU, except the one metadata read per step and stage
boundary that the design allows (pynccl/pipeline/p2p.py)."""
import copy
import warnings

import pytest
import torch
from torch import nn

import pynccl
from pynccl.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                             build_stage_module, split_into_stages)
from pynccl.testing import run_multiprocess

WIDTH = 64
TOL = 1e-5
mse = nn.functional.mse_loss

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _model(device, depth=8):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).to(device)


def _data(batch, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDTH, generator=g).to(device), torch.randn(batch, WIDTH, generator=g).to(device)


def _assert_grads(mods_and_ranges, ref, what):
    for mod, (start, end) in mods_and_ranges:
        ref_params = [p for layer in list(ref)[start:end] for p in layer.parameters()]
        for i, (p, q) in enumerate(zip(mod.parameters(), ref_params)):
            d = (p.grad - q.grad).abs().max().item()
            assert d <= TOL, f"{what}: layer range {start}:{end} parameter {i} gradient off by {d:.2e}"


def _count_syncs(fn):
    """Run fn with CUDA sync debugging on; returns how many host-GPU synchronisations it made."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # NOTE: turning the mode on warns once that it "is a prototype feature"; that is not a sync
    # (seen on the H200: it was the only message, and counted as one).
    syncs = [str(w.message) for w in caught
             if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]
    if syncs:
        print("host synchronisations:", *syncs, sep="\n  ")
    return len(syncs)


def _first_sync_site(sched, x, y):
    """Run one more step with synchronising calls turned into errors: where the first one is."""
    import traceback
    torch.cuda.set_sync_debug_mode("error")
    try:
        sched.step(x, target=y)
    except RuntimeError:
        return traceback.format_exc()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "(none on the second try)"


def _pipeline_on_gpus(rank, world_size):
    p = world_size
    device = pynccl.get_device()
    assert device.type == "cuda", device
    x, y = _data(16, device)
    full = _model(device)
    ref = copy.deepcopy(full)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    for cls in (ScheduleGPipe, Schedule1F1B):
        for m in sorted({1, 2, p, 2 * p, 8}):
            what = f"{cls.__name__} p={p} m={m} rank {rank}"
            print(what, flush=True)        # where a hang happened (pytest shows it with the failure)
            mod = build_stage_module(copy.deepcopy(full), rank, p)
            sched = cls(PipelineStage(mod, rank, p), m, mse)
            losses = []
            sched.step(x, target=y, losses=losses)          # first step: shapes travel
            mod.zero_grad(set_to_none=True)
            losses = []
            syncs = _count_syncs(lambda: sched.step(x, target=y, losses=losses))
            # One read of the "shapes unchanged" header per step on a receiving rank, none else.
            assert syncs == (0 if rank == 0 else 1), \
                f"{what}: {syncs} host synchronisations in a step; first one at:\n{_first_sync_site(sched, x, y)}"
            _assert_grads([(mod, split_into_stages(full, p)[rank])], ref, what)
            if rank == p - 1:
                assert abs(torch.stack(losses).mean().item() - ref_loss.item()) <= TOL, what
            bound = m if cls is ScheduleGPipe else min(p - rank, m)
            assert sched.peak_live_activations == bound, what
    # Interleaved, 2 stages per rank.
    print(f"ScheduleInterleaved1F1B p={p} m={2 * p} rank {rank}", flush=True)
    ranges = split_into_stages(full, 2 * p)
    mods = {k: build_stage_module(copy.deepcopy(full), k, 2 * p) for k in range(rank, 2 * p, p)}
    sched = ScheduleInterleaved1F1B([PipelineStage(mods[k], k, 2 * p) for k in mods], 2 * p, mse)
    sched.step(x, target=y)
    _assert_grads([(mods[k], ranges[k]) for k in mods], ref, f"interleaved p={p} rank {rank}")
    return True


@pytest.mark.gpu
@needs_gpu
def test_pipeline_p1_nccl():
    assert run_multiprocess(_pipeline_on_gpus, 1, backend="nccl", start_method="spawn", timeout=300) == [True]


@pytest.mark.multigpu
@needs_2_gpus
def test_pipeline_p2_nccl():
    assert run_multiprocess(_pipeline_on_gpus, 2, backend="nccl", start_method="spawn", timeout=120) == [True, True]
