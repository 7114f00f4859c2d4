"""ZeRO checkpoints through torch.distributed.checkpoint (DCP), on gloo, against torch's FSDP2.

Saved at world size 2 from ZeRO stages 1, 2, 3 and from FSDP2 (fully_shard on CPU); loaded at
world size 3 (uneven shards) into every stage and into FSDP2: 4 × 4 pairs. Each load must give
back the saved weights and optimizer state bit for bit (read back whole from the checkpoint with
DCP itself), and training on from there must follow the uninterrupted single-process run (same
tolerance as test_zero.py: other world sizes sum gradients in another order). At the saving world
size and stage, the resumed run's losses and weights must equal the uninterrupted run's exactly.
Also: model.state_dict() has FSDP2's structure (keys, Shard(0), local shapes, optimizer entries),
and dcp_to_torch_save turns each checkpoint into a state dict the plain model loads strictly.

One multi-process run per world size (process start costs seconds on two cores).
"""
import os

import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, Shard

import pynccl
from pynccl import zero
from pynccl.testing import run_multiprocess
import test_zero
from test_zero import GRAD_RTOL, LR, STEPS, global_batch, local, make_net

SAVED_AT = 2                         # steps before the checkpoint
SOURCES = ["zero1", "zero2", "zero3", "fsdp2"]
TARGETS = [1, 2, 3, "fsdp2"]
FULL = StateDictOptions(full_state_dict=True)


# ---------------------------------------------------------------------- models and their state dicts
def wrap(stage):
    model = pynccl.FullyShardedDataParallel(make_net(), stage=stage, bucket_cap_mb=0.0005)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def fsdp2(ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    net = make_net()
    mesh = init_device_mesh("cpu", (ws,))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=LR)


def build(target, ws):
    return fsdp2(ws) if target == "fsdp2" else wrap(target)


def get_sd(model, opt, options=None):
    """{"model", "optim"} state dicts: pynccl's functions for ZeRO, torch's for FSDP2."""
    if isinstance(model, pynccl.FullyShardedDataParallel):
        return {"model": model.state_dict() if options is None else zero.get_model_state_dict(model, options=options),
                "optim": zero.get_optimizer_state_dict(model, opt, options=options)}
    from torch.distributed.checkpoint import state_dict as tsd
    return {"model": tsd.get_model_state_dict(model, options=options),
            "optim": tsd.get_optimizer_state_dict(model, opt, options=options)}


def set_sd(model, opt, sd):
    if isinstance(model, pynccl.FullyShardedDataParallel):
        model.load_state_dict(sd["model"])
        zero.set_optimizer_state_dict(model, opt, sd["optim"])
    else:
        from torch.distributed.checkpoint import state_dict as tsd
        tsd.set_model_state_dict(model, sd["model"])
        tsd.set_optimizer_state_dict(model, opt, sd["optim"])


def load(model, opt, path):
    # Perturb first: a load that silently did nothing must not pass because both sides start alike.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sd = get_sd(model, opt)
    dcp.load(sd, checkpoint_id=path)
    set_sd(model, opt, sd)


def run_steps(model, opt, steps, rank, ws, device="cpu"):
    """Training steps; returns the global batch's loss of each (the mean of the ranks' losses)."""
    losses = []
    for step in steps:
        loss = model(*(t.to(device) for t in local(global_batch(step), rank, ws)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1).clone()
        pynccl.all_reduce(total)
        losses.append(total.item() / ws)
    return losses


def reference_losses():
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    return run_steps_plain(net, opt)


def run_steps_plain(net, opt):
    losses = []
    for step in range(STEPS):
        loss = net(*global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def whole(sd: dict) -> dict:
    """Every tensor of a (nested) state dict made whole, on CPU (collective for DTensors)."""
    if isinstance(sd, dict):
        return {k: whole(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [whole(v) for v in sd]
    if isinstance(sd, DTensor):
        return sd.full_tensor().cpu()
    return sd.detach().cpu().clone() if isinstance(sd, torch.Tensor) else sd


def _blank(like):
    if isinstance(like, dict):
        return {k: _blank(v) for k, v in like.items()}
    if isinstance(like, list):
        return [_blank(v) for v in like]
    return torch.full(like.shape, float("nan"), dtype=like.dtype) if isinstance(like, torch.Tensor) else None


def read_whole(path: str, like: dict) -> dict:
    """The checkpoint at `path` read back whole by DCP itself, into fresh plain tensors (NaN until
    read) shaped as `like`'s; non-tensor entries (param_groups' values) come back as saved."""
    target = _blank(like)
    dcp.load(target, checkpoint_id=path)
    return target


def assert_equal_nested(actual, expected, what):
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
        for k in expected:
            assert_equal_nested(actual[k], expected[k], f"{what}[{k}]")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_equal_nested(a, e, f"{what}[{i}]")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------- world size 2: save
def _like_fsdp2(ours: dict, theirs: dict, what: str) -> None:
    """Same keys, DTensor Shard(0) with the same local shapes, the same optimizer entries."""
    assert list(ours["model"]) == list(theirs["model"]) or sorted(ours["model"]) == sorted(theirs["model"]), what
    for k, v in theirs["model"].items():
        o = ours["model"][k]
        assert isinstance(o, DTensor) and o.placements == v.placements == (Shard(0),), (what, k, o)
        assert o.shape == v.shape and o.to_local().shape == v.to_local().shape, (what, k)
    assert list(ours["optim"]["state"]) == list(theirs["optim"]["state"]), what
    for k, st in theirs["optim"]["state"].items():
        assert sorted(ours["optim"]["state"][k]) == sorted(st), (what, k)
        for key, v in st.items():
            o = ours["optim"]["state"][k][key]
            assert type(o) is type(v) and o.shape == v.shape, (what, k, key, type(o), type(v))
            if isinstance(v, DTensor):
                assert o.to_local().shape == v.to_local().shape, (what, k, key)
    assert [g["params"] for g in ours["optim"]["param_groups"]] == \
        [g["params"] for g in theirs["optim"]["param_groups"]], what


def _save_side(rank, ws, root):
    net, opt = fsdp2(ws)
    run_steps(net, opt, range(SAVED_AT), rank, ws)
    theirs = get_sd(net, opt)
    dcp.save(theirs, checkpoint_id=os.path.join(root, "fsdp2"))
    in_memory, _ = wrap(3)                             # FSDP2's DTensors (same ranks) load as they are
    in_memory.load_state_dict(net.state_dict())
    assert_equal_nested(in_memory.full_state_dict(), whole(get_sd(net, opt, FULL))["model"], "FSDP2 in memory")
    for stage in (1, 2, 3):
        name = f"zero{stage}"
        model, opt = wrap(stage)
        run_steps(model, opt, range(SAVED_AT), rank, ws)
        ours = get_sd(model, opt)
        _like_fsdp2(ours, theirs, name)
        dcp.save(ours, checkpoint_id=os.path.join(root, name))
        # Resumed at the same world size and stage: exactly the uninterrupted run.
        uninterrupted = run_steps(model, opt, range(SAVED_AT, STEPS), rank, ws)
        fresh, fresh_opt = wrap(stage)
        load(fresh, fresh_opt, os.path.join(root, name))
        resumed = run_steps(fresh, fresh_opt, range(SAVED_AT, STEPS), rank, ws)
        assert resumed == uninterrupted, f"{name}: resumed losses {resumed} != uninterrupted {uninterrupted}"
        assert_equal_nested(whole(get_sd(fresh, fresh_opt)), whole(get_sd(model, opt)), f"{name} resumed")
    _options_and_errors(rank, ws)
    _frozen_and_sgd_save(rank, ws, root)
    return True


def _options_and_errors(rank, ws):
    """StateDictOptions, FSDP1's state_dict_type and the errors, against the full state dict."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    model, opt = wrap(3)
    run_steps(model, opt, range(1), rank, ws)
    full, full_optim = model.full_state_dict(), model.full_optim_state_dict(opt)
    assert_equal_nested(zero.get_model_state_dict(model, options=FULL), full, "full_state_dict=True")
    assert_equal_nested(whole(model.state_dict()), full, "sharded state dict made whole")
    offloaded = zero.get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    assert all(v.to_local().device.type == "cpu" for v in offloaded.values() if isinstance(v, DTensor))
    assert_equal_nested(whole(offloaded), full, "cpu_offload=True")
    rank0 = zero.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert (rank0 == {}) == (rank != 0)
    named = zero.get_optimizer_state_dict(model, opt, options=FULL)       # keyed by name, as torch's
    names = [n for n, _ in make_net().named_parameters()]
    assert list(named["state"]) == names and named["param_groups"][0]["params"] == names
    for i, name in enumerate(names):
        assert_equal_nested(named["state"][name], full_optim["state"][i], f"full optimizer state of {name}")
    with model.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        assert_equal_nested(model.state_dict(), full, "FULL_STATE_DICT")
        assert_equal_nested(model.optim_state_dict(model, opt), named, "FSDP1 optim_state_dict")
    assert isinstance(model.state_dict()["emb.weight"], DTensor), "the context manager restores the setting"
    previous = pynccl.FullyShardedDataParallel.set_state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True))
    assert previous.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert (model.state_dict() == {}) == (rank != 0)
    model.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    # Flattened (torch's flatten_optimizer_state_dict) round trip, and FSDP1's optim_state_dict_to_load.
    flat = zero.get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert "state.emb.weight.exp_avg" in flat and "param_groups.head.weight.lr" not in flat
    other, other_opt = wrap(1)
    zero.set_optimizer_state_dict(other, other_opt, flat)
    assert_equal_nested(other.full_optim_state_dict(other_opt), full_optim, "flattened optimizer state, stage 3 -> 1")
    other_opt.load_state_dict(other.optim_state_dict_to_load(other, other_opt, named))
    assert_equal_nested(other.full_optim_state_dict(other_opt), full_optim, "optim_state_dict_to_load")
    # Non-strict loading reports the keys; strict raises what torch raises (a RuntimeError).
    sd = model.state_dict()
    missing = other.load_state_dict({k: v for k, v in sd.items() if k != "norm.bias"}, strict=False)
    assert missing.missing_keys == ["norm.bias"] and missing.unexpected_keys == []
    with pytest.raises(RuntimeError, match=r"missing keys \['norm.bias'\]"):
        other.load_state_dict({k: v for k, v in sd.items() if k != "norm.bias"})
    with pytest.raises(ValueError, match=r"'norm.weight' has shape \(6,\), expected \(5,\)"):
        other.load_state_dict({**sd, "norm.weight": torch.zeros(6)})
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT"):
        model.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
    with pytest.raises(ValueError, match="broadcast_from_rank0"):
        zero.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with pytest.raises(TypeError, match="expected a pynccl.FullyShardedDataParallel"):
        zero.get_model_state_dict(make_net())
    with pytest.raises(KeyError, match="not parameter names"):
        zero.set_optimizer_state_dict(model, opt, {"state": {"nope.weight": {}}, "param_groups": []})


def _frozen_net():
    net = make_net()
    net.norm.requires_grad_(False)
    with torch.no_grad():
        net.norm.weight.mul_(1.5)                      # frozen, but not at its initial value
    return net


def _frozen_and_sgd_save(rank, ws, root):
    """Two more sources: a frozen parameter (whole on every rank), and SGD's momentum_buffer."""
    model = pynccl.FullyShardedDataParallel(_frozen_net(), stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run_steps(model, opt, range(SAVED_AT), rank, ws)
    sd = get_sd(model, opt)
    assert isinstance(sd["model"]["norm.weight"], DTensor) and "norm.weight" not in sd["optim"]["state"]
    assert "norm.weight" not in zero.get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    dcp.save(sd, checkpoint_id=os.path.join(root, "frozen"))
    model = pynccl.FullyShardedDataParallel(make_net(), stage=2, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    run_steps(model, opt, range(SAVED_AT), rank, ws)
    dcp.save(get_sd(model, opt), checkpoint_id=os.path.join(root, "sgd"))


def _frozen_and_sgd_load(rank, ws, root):
    for path, net, make_opt, stage in (("frozen", _frozen_net, lambda ps: torch.optim.AdamW(ps, lr=LR), 1),
                                       ("sgd", make_net, lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), 3)):
        model = pynccl.FullyShardedDataParallel(net(), stage=stage, bucket_cap_mb=0.0005)
        opt = make_opt(model.parameters())
        load(model, opt, os.path.join(root, path))
        loaded = whole(get_sd(model, opt, FULL))
        assert_equal_nested(loaded, read_whole(os.path.join(root, path), loaded), f"{path} (ws 2) -> ws {ws}")
        assert path != "sgd" or "momentum_buffer" in loaded["optim"]["state"]["emb.weight"]


# ---------------------------------------------------------------------- world size 3: load
def _load_side(rank, ws, root, ref_losses):
    expected_params = test_zero.reference()[0]        # {key: (value, element-wise bound)}
    for source in SOURCES:
        path = os.path.join(root, source)
        for target in TARGETS:
            what = f"{source} (ws 2) -> {'stage ' if target != 'fsdp2' else ''}{target} (ws {ws})"
            model, opt = build(target, ws)
            load(model, opt, path)
            loaded = whole(get_sd(model, opt, FULL))
            assert_equal_nested(loaded, read_whole(path, loaded), what)
            losses = run_steps(model, opt, range(SAVED_AT, STEPS), rank, ws)
            # a loss is the forward chain's output: within the chain's relative bound
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[SAVED_AT:]), rtol=GRAD_RTOL, atol=0,
                                       msg=lambda m: f"{what}: losses {losses} vs {ref_losses[SAVED_AT:]}: {m}")
            test_zero.assert_close(whole(get_sd(model, opt, FULL)["model"]), expected_params, what)
    _frozen_and_sgd_load(rank, ws, root)
    return True


def _plain():
    net = make_net()
    return net, torch.optim.AdamW(net.parameters(), lr=LR)


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp_ws2"))
    assert run_multiprocess(_save_side, 2, args=(root,), timeout=300) == [True] * 2
    return root


def test_resume_at_other_world_size_stage_and_fsdp2(checkpoints):
    ref_losses, _ = run_steps_plain(*_plain())
    assert run_multiprocess(_load_side, 3, args=(checkpoints, ref_losses), timeout=600) == [True] * 3


def test_dcp_to_torch_save_loads_into_the_plain_model(checkpoints, tmp_path):
    """Each checkpoint converts to one torch.save file whose "model" loads strictly into the
    unwrapped model, equal to the checkpoint's tensors, and whose "optim" is keyed by names."""
    for source in SOURCES:
        out = str(tmp_path / f"{source}.pt")
        dcp_to_torch_save(os.path.join(checkpoints, source), out)
        sd = torch.load(out, weights_only=False)
        net, _ = _plain()
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
        net.load_state_dict(sd["model"], strict=True)
        for k, v in net.state_dict().items():
            assert torch.equal(v, sd["model"][k]), (source, k)
        assert any(v.abs().sum() > 0 for v in net.state_dict().values())
        assert sorted(sd["optim"]["state"]) == sorted(n for n, _ in net.named_parameters())
        for name, p in net.named_parameters():
            st = sd["optim"]["state"][name]
            assert st["exp_avg"].shape == p.shape and float(st["step"]) == SAVED_AT, (source, name)
