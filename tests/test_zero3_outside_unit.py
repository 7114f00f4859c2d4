"""ZeRO-3 parameters read outside the forward of their unit: the module attribute reports the
parameter's shape, dtype, device and requires_grad, and any op on it raises ShardedParameterError
naming the parameter (it once held an empty tensor: weight.sum() returned 0, weight.shape
torch.Size([0])). Inside forward nothing changed: each step's loss and gradient rows equal the
unwrapped model's on the whole batch, with a torch.compile'd unit too, and 5 AdamW steps land
within tests/test_zero.py's bounds.

test_zero.py's Net: the embedding tied to the head and a norm in the root unit, three blocks as
units. One 2-rank gloo run holds every case; each case's outcome is a test.
"""
import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
import torch.nn.functional as F
from torch import nn

import pynccl
from pynccl.errors import ShardedParameterError
from pynccl.testing import run_multiprocess
from pynccl.zero import MixedPrecision
from pynccl.zero.params import collect_params
from pynccl.zero.placeholder import make_placeholders
from test_zero import D, GRAD_RTOL, LR, STEPS, adamw, assert_close, global_batch, local, make_net, reference

WS = 2
NAMES = [n for n, _ in make_net().named_parameters(remove_duplicate=False)]   # head.weight too (tied)
# Every op on a placeholder, reads and in-place writes, with grad on and off.
OPS = {
    "sum": lambda w: w.sum(),
    "F.linear": lambda w: F.linear(torch.ones(2, w.shape[-1]), w),
    "item": lambda w: w.reshape(-1)[0].item(),
    "float": lambda w: float(w.reshape(-1)[0]),
    "tolist": lambda w: w.tolist(),
    "add_": lambda w: w.add_(1.0),
    "copy_": lambda w: w.copy_(torch.zeros(w.shape)),
    "add_ under no_grad": lambda w: _no_grad(lambda: w.add_(1.0)),
    "setitem": lambda w: w.__setitem__(0, 0.0),
    "torch.cat": lambda w: torch.cat([w, w]),
}


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def attr(module: nn.Module, name: str):
    """What the module's code reads as `name` (the instance __dict__ first, as attribute lookup does)."""
    mod_name, _, a = name.rpartition(".")
    return getattr(module.get_submodule(mod_name), a)


def error_words(name: str):
    """What the error says about parameter `name` (tied: emb.weight's error names head.weight too)."""
    return ["sharded by ZeRO-3", "outside the forward of its unit", "model.full_state_dict()", f"'{name}'"]


def check_outside(model, plain: dict, placeholders: dict, ops=("sum",)) -> None:
    """Every parameter as the module sees it between forwards: the wrap-time placeholder (the same
    object), with the original's metadata; each op in `ops` raises naming the parameter."""
    for name in NAMES:
        w, p = attr(model.module, name), plain[name]
        assert w is placeholders[name], f"{name}: a new placeholder object"
        assert (w.shape, w.dtype, w.device, w.requires_grad) == (p.shape, p.dtype, p.device, p.requires_grad), name
        assert (w.dim(), w.numel(), len(w), w.size(0)) == (p.dim(), p.numel(), len(p), p.size(0)), name
        first = "emb.weight" if name == "head.weight" else name
        for what in ops:
            with pytest.raises(ShardedParameterError) as e:
                OPS[what](w)
            assert all(s in str(e.value) for s in error_words(first)), f"{name} {what}: {e.value}"


# ---------------------------------------------------------------------- cases
def case_outside_reads(rank, ws):
    """Before any forward and between steps: metadata of the original, every op raises; the
    tied weight is one placeholder under both names; repr says what it is."""
    plain = dict(make_net().named_parameters(remove_duplicate=False))
    model = pynccl.FullyShardedDataParallel(make_net(), stage=3)
    assert len(model.units) == 4                       # the root (emb/head, norm) and three blocks
    placeholders = {n: attr(model.module, n) for n in NAMES}
    assert placeholders["head.weight"] is placeholders["emb.weight"]
    check_outside(model, plain, placeholders, ops=OPS)
    model(*local(global_batch(0), rank, ws)).backward()
    check_outside(model, plain, placeholders, ops=OPS)
    r = repr(model.module.blocks[0].fc1.weight)
    assert "blocks.0.fc1.weight" in r and "sharded by ZeRO-3" in r, r
    assert "Block" in repr(model.module)               # the module's own repr is untouched
    # The nn.Parameters stay what named_parameters() and the optimizer see: this rank's rows.
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def case_mixed_precision(rank, ws):
    """bf16 compute: inside forward the attribute is the bf16 full tensor, outside the parameter's
    own fp32 metadata (what model.parameters() hold)."""
    model = pynccl.FullyShardedDataParallel(make_net(), stage=3, mixed_precision=MixedPrecision(torch.bfloat16))
    inside = []
    model.module.blocks[1].fc1.register_forward_pre_hook(lambda m, a: inside.append((m.weight.dtype, m.weight.shape)))
    model(*local(global_batch(0), rank, ws)).backward()
    w = model.module.blocks[1].fc1.weight
    assert inside == [(torch.bfloat16, torch.Size([9, D]))], inside
    assert (w.dtype, w.shape) == (torch.float32, torch.Size([9, D]))
    with pytest.raises(ShardedParameterError, match="'blocks.1.fc1.weight'"):
        w.sum()


def case_training_unchanged(rank, ws, compiled):
    """Each step's loss and gradient rows equal the unwrapped model's on the whole batch; forward
    hooks inside a unit read the real values; outside reads between steps change nothing; the
    parameters after STEPS AdamW steps within test_zero's bounds (compiled: blocks[1] compiled)."""
    plain = dict(make_net().named_parameters(remove_duplicate=False))
    ref = make_net()
    ref_opt = adamw(ref.parameters())
    net = make_net()
    if compiled:
        net.blocks[1].compile(backend="aot_eager")
    model = pynccl.FullyShardedDataParallel(net, stage=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    placeholders = {n: attr(model.module, n) for n in NAMES}
    inside = []
    model.module.blocks[1].fc1.register_forward_pre_hook(lambda m, a: inside.append(m.weight.detach().clone()))
    infos = {n: i for i in model._param_infos for n in i.names}
    for step in range(STEPS):
        batch = global_batch(step)
        ref_loss = ref(*batch)
        ref_loss.backward()
        loss = model(*local(batch, rank, ws))
        loss.backward()
        loss = loss.detach().clone()
        pynccl.all_reduce(loss, op=pynccl.ReduceOp.AVG)
        assert abs(float(loss) - float(ref_loss)) <= GRAD_RTOL * abs(float(ref_loss)), (step, loss, ref_loss)
        ref_params = dict(ref.named_parameters())
        for name, p in model.module.named_parameters():
            unit_idx, slot = infos[name].location
            expected = model.units[unit_idx].layout.local_part(rank, slot, ref_params[name].grad)
            # Each element within the model's fp32 reduction chain (test_zero.GRAD_RTOL) of the
            # parameter's largest gradient: the batch split sums tokens in another order.
            atol = GRAD_RTOL * float(ref_params[name].grad.abs().max())
            torch.testing.assert_close(p.grad, expected, rtol=0, atol=atol, msg=f"step {step} grad of {name}")
        if step == 0:
            assert torch.equal(inside[0], plain["blocks.1.fc1.weight"].detach()), "a forward hook read other values"
        check_outside(model, plain, placeholders)      # between backward and step
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        check_outside(model, plain, placeholders)
    assert len(inside) == STEPS
    assert_close(model.full_state_dict(), reference()[0], f"stage 3 (compiled={compiled}) with outside reads")


def _outcome(fn, *args):
    """None, or what the case raised (reported by its test)."""
    try:
        fn(*args)
    except Exception as e:                             # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _cases(rank, ws):
    return {"outside_reads": _outcome(case_outside_reads, rank, ws),
            "mixed_precision": _outcome(case_mixed_precision, rank, ws),
            "training": _outcome(case_training_unchanged, rank, ws, False),
            "training_compiled": _outcome(case_training_unchanged, rank, ws, True)}


@pytest.fixture(scope="module")
def outcomes():
    torch._dynamo.reset()
    return run_multiprocess(_cases, WS, timeout=240)


def _check(outcomes, key):
    for rank, outcome in enumerate(outcomes):
        assert outcome[key] is None, f"rank {rank}: {outcome[key]}"


# ---------------------------------------------------------------------- tests
def test_outside_reads_report_metadata_and_every_op_raises(outcomes):
    _check(outcomes, "outside_reads")


def test_outside_reads_report_the_parameter_dtype_under_mixed_precision(outcomes):
    _check(outcomes, "mixed_precision")


def test_training_equals_the_unwrapped_model_with_outside_reads(outcomes):
    _check(outcomes, "training")


def test_training_with_a_compiled_unit_equals_the_unwrapped_model(outcomes):
    _check(outcomes, "training_compiled")


def test_the_error_message():
    """No processes: the placeholders of one unit, as stage3.py makes them."""
    root = nn.Sequential(nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 2)]))
    infos, _ = collect_params(root)
    weight, bias = make_placeholders(root[1][0], infos[2:], torch.device("cpu"))
    assert (weight.shape, weight.dtype, weight.requires_grad, bias.shape) == ((2, 4), torch.float32, True, (2,))
    with pytest.raises(ShardedParameterError) as e:
        weight.sum()
    assert str(e.value) == (
        "'1.0.weight' is sharded by ZeRO-3 (FullyShardedDataParallel(stage=3)) and was used outside the forward of "
        "its unit ('1.0' (Linear)): there the module attribute holds no values, only the parameter's shape [2, 4], "
        "dtype torch.float32 and device cpu, and sum needs its values. Use it inside the forward of a module of that "
        "unit (make the module that uses it part of the unit: wrap_modules=), or get the full values from "
        "model.full_state_dict() (collective; also model.state_dict() after "
        "FullyShardedDataParallel.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)).")
    assert isinstance(e.value, RuntimeError)
    (root_weight,) = make_placeholders(None, infos[:1], torch.device("cpu"))
    with pytest.raises(ShardedParameterError, match=r"'0.weight' .* \(the root unit, gathered only during"):
        root_weight.add_(1)
