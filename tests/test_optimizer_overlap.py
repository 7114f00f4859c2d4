"""DDP.overlap_optimizer (issue 26): the optimizer stepped a bucket at a time in backward gives the
same parameters, bit for bit, as the same optimizer stepped after backward, for torch's optimizers
in all three implementations, with nanoGPT-style param groups, an LR scheduler on the user's
optimizer, and a state_dict save/load in the middle; refusals name what is not supported.
"""
import copy

import pytest
import torch
import torch.nn as nn

import pynccl
from pynccl.testing import run_multiprocess

STEPS = 5


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def _groups(model):
    # nanoGPT's configure_optimizers: weight decay on matrices, none on biases
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw-forloop": lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False),
    "adamw-foreach": lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=True),
    "adamw-fused": lambda g: torch.optim.AdamW(g, lr=1e-2, fused=True),
    "sgd-momentum": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
}


def _train(device, make_opt, overlap: bool, save_at=None):
    model = pynccl.DistributedDataParallel(_net().to(device), bucket_cap_mb=0.004)
    opt = make_opt(_groups(model.module))
    if overlap:
        assert model.overlap_optimizer(opt) is opt
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator(device="cpu").manual_seed(1 + pynccl.get_rank())
    losses = []
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 8, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step == save_at:                              # a checkpoint round trip in the middle
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # new tensors, as from a file
    return losses, [p.detach().clone() for p in model.module.parameters()], opt.state_dict()


def _equal_to_step_after_backward(rank, world_size, device="cpu"):
    assert len(pynccl.DistributedDataParallel(_net().to(device), bucket_cap_mb=0.004).reducer.bucketer.buckets) > 2
    for name, make in OPTIMIZERS.items():
        if name == "adamw-fused" and device == "cpu" and not hasattr(torch._C._VariableFunctions, "_fused_adamw_"):
            continue
        ref_losses, ref_params, ref_state = _train(device, make, overlap=False)
        losses, params, state = _train(device, make, overlap=True, save_at=2)
        assert losses == ref_losses, name
        for a, b in zip(params, ref_params):
            assert torch.equal(a, b), name
        assert state["param_groups"] == ref_state["param_groups"], name      # the scheduler's LR too
        for k, v in ref_state["state"].items():
            for key, t in v.items():
                assert torch.equal(state["state"][k][key], t), (name, k, key)


def test_overlapped_steps_equal_steps_after_backward_on_gloo():
    run_multiprocess(_equal_to_step_after_backward, 2)


def _refusals(rank, world_size):
    model = pynccl.DistributedDataParallel(_net(), find_unused_parameters=True)
    with pytest.raises(ValueError, match="find_unused_parameters=True is not supported"):
        model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model = pynccl.DistributedDataParallel(_net())
    with pytest.raises(ValueError, match="1 of its parameters are not the model's"):
        model.overlap_optimizer(torch.optim.SGD(list(model.parameters()) + [nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer, got list"):
        model.overlap_optimizer([])
    opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="already overlapped"):
        model.overlap_optimizer(opt)
    with pytest.raises(ValueError, match=r"step\(closure\) is not supported"):
        opt.step(lambda: 0.0)


def test_refusals_name_what_is_not_supported():
    run_multiprocess(_refusals, 2)


def _equal_on_nccl(rank, world_size):
    _equal_to_step_after_backward(rank, world_size, device="cuda")


@pytest.mark.multigpu
def test_overlapped_steps_equal_steps_after_backward_on_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_multiprocess(_equal_on_nccl, 2, backend="nccl", start_method="spawn", timeout=300)
