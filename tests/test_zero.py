"""ZeRO stages 1-3 (pynccl.FullyShardedDataParallel) on gloo against a single-process run on
the same global batch: parameters after 5 AdamW steps within the bounds tests/numerics.py derives
(fp32 reduction order, AdamW element-wise), also with gradient clipping and with accumulation;
mixed precision against a single-process emulation of the same casts (the first step's reduced
gradient element-wise, then 5 SGD and 5 AdamW steps); checkpoints (sharded and full) resumed at
another world size and stage.

One multi-process run per world size does all of it (process start costs seconds on two
cores). World size 3 gives uneven shards; the ws-4 run writes the checkpoints the ws-2 run
resumes from (the `ws4_checkpoint` fixture), so ws-2 alone still works.
"""
import copy
import os

import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
import torch.nn.functional as F
from torch import nn

import pynccl
from pynccl.testing import run_multiprocess
from pynccl.checkpoint_io import atomic_save
from pynccl.zero import MixedPrecision
from numerics import assert_within, chain_rtol, eps, record_grad_scale, trained_atol

V, D, H, SEQ, GLOBAL_BATCH, STEPS, LR = 11, 5, 9, 4, 12, 5, 1e-2
# Gradients, relative: Net's reduction chain, forward and backward (3 blocks of LayerNorm 5, fc1
# 5, fc2 9; the head 5 forward, 11 backward; the loss's softmax over 11 and mean over 48 tokens;
# each weight gradient's sum over 48 tokens): 242 · eps = 2.9e-5.
GRAD_RTOL = chain_rtol(2 * 3 * (5 + 5 + 9), 2 * 5, 2 * 11, 2 * GLOBAL_BATCH * SEQ)
NUM_PARAMS = 407               # Net's elements (the tied head counted once): the clip norm's sum of squares


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """GPT-shaped: embedding tied to the head (a shared parameter), blocks in a ModuleList.
    Unit sizes (65, 114 elements) leave uneven shards at world sizes 2, 3 and 4."""

    def __init__(self, unused=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight
        if unused:
            self.spare = nn.Linear(D, D)

    def forward(self, idx, tgt):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1))


def make_net(**kw):
    torch.manual_seed(0)
    return Net(**kw)


def global_batch(step, micro=0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g))


def local(batch, rank, ws):
    n = GLOBAL_BATCH // ws
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


def train(model, opt, steps, rank=0, ws=1, clip=None, accum=1, wrapped=True, grad_scale=None):
    """Steps of the loop users write; returns the clip norms. rank/ws pick the local batch;
    grad_scale (a dict) gets each parameter's largest |gradient| (numerics.record_grad_scale)."""
    norms = []
    for step in steps:
        for micro in range(accum):
            batch = local(global_batch(step, micro), rank, ws)
            last = micro == accum - 1
            ctx = model.no_sync() if wrapped and not last else _null()
            with ctx:
                loss = model(*batch) / accum
                loss.backward()
        if clip is not None:
            norm = model.clip_grad_norm_(clip) if wrapped else nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm))
        if grad_scale is not None:
            record_grad_scale(model.parameters(), grad_scale)
        opt.step()
        opt.zero_grad()
    return norms


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def reference(steps=range(STEPS), clip=None, accum=1, start=None, make_opt=adamw):
    """The plain model on one process: ({state_dict key: (value, element-wise bound)}, clip norms)."""
    net = make_net()
    opt = make_opt(net.parameters())
    if start is not None:
        net.load_state_dict(start["model"])
        opt.load_state_dict(start["optim"])
    scale = {}
    norms = train(net, opt, steps, clip=clip, accum=accum, wrapped=False, grad_scale=scale)
    return expected_state(net, opt, scale, steps[-1] + 1, GRAD_RTOL), norms


def expected_state(net, opt, grad_scale, steps, grad_rtol):
    """{state_dict key: (the reference's value, numerics.trained_atol)}; the tied head under both names."""
    params = {p.data_ptr(): p for p in net.parameters()}
    out = {}
    for k, v in net.state_dict().items():
        p = params.get(v.data_ptr())
        out[k] = (v.detach().clone(), 0.0 if p is None else trained_atol(opt, p, grad_rtol, grad_scale.get(p), steps))
    return out


def reference_mixed(ws, reduce_dtype, make_opt=adamw):
    """Single process doing what MixedPrecision(bf16) promises: each rank's forward/backward on
    bf16 copies of fp32 masters, gradients averaged in `reduce_dtype`, the optimizer on the
    masters. Returns the masters' expected state and, for the first step, each parameter's mean
    gradient and the mean of its ranks' |gradients| (the scale of the reduction's rounding)."""
    master = make_net()
    opt = make_opt(master.parameters())
    scale, first = {}, None
    for step in range(STEPS):
        grads = []
        for r in range(ws):
            bf = copy.deepcopy(master).to(torch.bfloat16)
            bf(*local(global_batch(step), r, ws)).backward()
            grads.append([p.grad.to(reduce_dtype) for p in bf.parameters()])
        for p, gs in zip(master.parameters(), zip(*grads)):
            p.grad = (sum(gs) / ws).float()
        if first is None:
            first = {name: (p.grad.clone(), sum(g.float().abs() for g in gs) / ws)
                     for (name, p), gs in zip(master.named_parameters(), zip(*grads))}
        record_grad_scale(master.parameters(), scale)
        opt.step()
        opt.zero_grad()
    # Gradients, relative: both sides run the same bf16 forward/backward on bf16 casts of masters
    # that differ by rounding, so a cast may land one bf16 ulp apart (eps(bf16)); then the mean of
    # ws gradients in reduce_dtype, summed and scaled in another order ((ws + 1) · eps).
    grad_rtol = eps(torch.bfloat16) + (ws + 1) * eps(reduce_dtype)
    return expected_state(master, opt, scale, STEPS, grad_rtol), first


def assert_close(actual, expected, what):
    """actual: a state dict; expected: expected_state's {key: (value, bound)}."""
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    for k, (value, atol) in expected.items():
        assert_within(actual[k], value, atol, f"{what} [{k}]")


def wrap(stage, mp=None, **kw):
    model = pynccl.FullyShardedDataParallel(make_net(**kw), stage=stage, mixed_precision=mp, bucket_cap_mb=0.0005)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


# ---------------------------------------------------------------------- checks run on every rank
def _exactness(rank, ws):
    plain, (clipped, ref_norms), accum = reference()[0], reference(clip=0.5), reference(accum=2)[0]
    for stage in (1, 2, 3):
        model, opt = wrap(stage)
        # The module's own parameters, original names and dims, each holding this rank's rows.
        plain_params = dict(make_net().named_parameters())
        assert [(n, p.dim()) for n, p in model.named_parameters()] == \
            [("module." + n, p.dim()) for n, p in plain_params.items()]
        assert sum(p.numel() for p in model.parameters()) <= sum(u.layout.shard_numel for u in model.units)
        assert all(p.shape[1:] == plain_params[n[len("module."):]].shape[1:] for n, p in model.named_parameters())
        train(model, opt, range(STEPS), rank, ws)
        assert_close(model.full_state_dict(), plain, f"stage {stage} ws {ws}")
        if stage == 3:
            assert not any(u.is_allocated for u in model.units), "stage 3 must free every unit after backward"
            mem = model.memory_bytes(opt)
            assert mem["params"] == sum(u.shard.numel() * 4 for u in model.units), mem

        model, opt = wrap(stage)
        norms = train(model, opt, range(STEPS), rank, ws, clip=0.5)
        assert_close(model.full_state_dict(), clipped, f"stage {stage} ws {ws} clipped")
        # The norm: a sum of NUM_PARAMS squares in another order, of gradients GRAD_RTOL apart.
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=chain_rtol(NUM_PARAMS) + GRAD_RTOL,
                                   atol=0)
        assert min(ref_norms) > 0.5, "clip threshold must be active for the test to mean anything"

        model, opt = wrap(stage)
        train(model, opt, range(STEPS), rank, ws, accum=2)
        assert_close(model.full_state_dict(), accum, f"stage {stage} ws {ws} accumulated")


def _no_sync_is_silent(rank, ws):
    import pynccl.zero.flat_unit as fu
    calls = []
    real = fu.dist.reduce_scatter_tensor
    fu.dist.reduce_scatter_tensor = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for stage in (1, 2, 3):
            model, opt = wrap(stage)
            calls.clear()
            with model.no_sync():
                model(*local(global_batch(0), rank, ws)).backward()
            assert not calls, f"stage {stage}: no_sync backward communicated ({len(calls)} reduce-scatters)"
            assert all(p.grad is None for p in model.parameters())
            model(*local(global_batch(0), rank, ws)).backward()
            assert len(calls) == len(model.units) and all(p.grad is not None for p in model.parameters())
    finally:
        fu.dist.reduce_scatter_tensor = real


def _stage2_overlaps(rank, ws):
    """Stage 2 reduce-scatters (and frees) finished buckets while backward still runs; stage 1 waits."""
    for stage, expect_freed in ((1, False), (2, True)):
        model, _ = wrap(stage)
        rt = model._runtime
        seen = []

        def watch(module, args, out):
            # By now backward has finished bucket 0 (final norm, last blocks), not the embedding.
            out.register_hook(lambda g: seen.append(all(leaf.grad is None for leaf in rt.unit_leaves[0])))
        handle = model.module.emb.register_forward_hook(watch)
        model(*local(global_batch(0), rank, ws)).backward()
        handle.remove()
        assert len(rt.units) >= 3 and seen == [expect_freed], (stage, seen)


def _other_optimizers(rank, ws):
    """SGD with momentum and Adam with amsgrad are element-wise too: exact on flat shards, and
    their state (momentum_buffer, max_exp_avg_sq) survives a full optimizer state dict."""
    makers = [lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, nesterov=True),
              lambda ps: torch.optim.Adam(ps, lr=LR, amsgrad=True)]
    for make_opt, stage in zip(makers, (2, 3)):
        expected = reference(make_opt=make_opt)[0]
        model = pynccl.FullyShardedDataParallel(make_net(), stage=stage, bucket_cap_mb=0.0005)
        opt = make_opt(model.parameters())
        train(model, opt, range(2), rank, ws)
        osd = model.full_optim_state_dict(opt)
        resumed = pynccl.FullyShardedDataParallel(make_net(), stage=1, bucket_cap_mb=0.0005)
        resumed_opt = make_opt(resumed.parameters())
        resumed.load_full_state_dict(model.full_state_dict(), osd, resumed_opt)
        train(resumed, resumed_opt, range(2, STEPS), rank, ws)
        assert_close(resumed.full_state_dict(), expected, f"{type(opt).__name__} stage {stage} -> 1")


def _eval_between_forward_and_backward(rank, ws):
    """A no-grad forward (evaluation) between a training forward and its backward changes nothing."""
    expected = reference(steps=range(2))[0]
    for stage in (1, 2, 3):
        model, opt = wrap(stage)
        for step in range(2):
            loss = model(*local(global_batch(step), rank, ws))
            with torch.no_grad(), model.no_sync():
                model(*local(global_batch(99), rank, ws))
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert_close(model.full_state_dict(), expected, f"stage {stage}: eval forward before backward")


def _mixed_precision(rank, ws):
    """The first step's reduced gradient element-wise (a missed or doubled 1/ws is off by a
    factor; the bound is the reduction's rounding of the ranks' gradients), read back from the
    masters after one SGD step of lr 1; then 5 SGD and 5 AdamW steps against the emulation."""
    for reduce_dtype in (torch.float32, torch.bfloat16):
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        _, first = reference_mixed(ws, reduce_dtype, make_opt=lambda ps: torch.optim.SGD(ps, lr=1.0))
        for stage in (1, 2, 3):
            model, _ = wrap(stage, mp)
            before = model.full_state_dict()
            train(model, torch.optim.SGD(model.parameters(), lr=1.0), range(1), rank, ws)
            after = model.full_state_dict()
            for name, (mean, abs_mean) in first.items():
                # (ws + 1) roundings of the reduce dtype over the ranks' |gradients|, and the
                # fp32 subtraction that reads the gradient back (|p| · eps on each side).
                atol = (ws + 1) * eps(reduce_dtype) * abs_mean + 2 * eps() * before[name].abs()
                assert_within(before[name] - after[name], mean, atol,
                              f"mixed stage {stage} reduce {reduce_dtype}: first reduced gradient of {name}")
        for make_opt in (lambda ps: torch.optim.SGD(ps, lr=LR * 10, momentum=0.9), adamw):
            ref, _ = reference_mixed(ws, reduce_dtype, make_opt)
            for stage in (1, 2, 3):
                model, _ = wrap(stage, mp)
                opt = make_opt(model.parameters())
                dtypes = []
                model.module.blocks[1].fc1.register_forward_pre_hook(lambda m, a: dtypes.append(m.weight.dtype))
                assert all(p.dtype == torch.float32 for p in model.parameters())
                assert all(u.reduce_dtype == reduce_dtype for u in model.units)
                train(model, opt, range(STEPS), rank, ws)
                assert set(dtypes) == {torch.bfloat16}, dtypes
                assert all(p.grad is None for p in model.parameters())
                assert_close(model.full_state_dict(), ref, f"mixed stage {stage} reduce {reduce_dtype} {type(opt).__name__}")


def _subgroups(rank, ws):
    """Two independent data-parallel groups {0, 1} and {2, 3} (process_group=)."""
    groups = [pynccl.new_group([0, 1]), pynccl.new_group([2, 3])]
    group = groups[rank // 2]
    expected = reference()[0]
    for stage in (1, 3):
        model = pynccl.FullyShardedDataParallel(make_net(), stage=stage, process_group=group, bucket_cap_mb=0.0005)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        train(model, opt, range(STEPS), group.group_rank, group.world_size)
        assert_close(model.full_state_dict(), expected, f"stage {stage} on group {group.ranks}")


def _write_checkpoints(rank, ws, ckpt_dir):
    model, opt = wrap(3)
    train(model, opt, range(2), rank, ws)
    full = {"model": model.full_state_dict(), "optim": model.full_optim_state_dict(opt)}
    if rank == 0:
        atomic_save(full, os.path.join(ckpt_dir, "full.pt"))
    model.save_sharded(os.path.join(ckpt_dir, "sharded"), opt)
    assert sorted(os.listdir(os.path.join(ckpt_dir, "sharded"))) == [f"rank{r:05d}-of-{ws:05d}.pt" for r in range(ws)]


def _resume_elsewhere(rank, ws, ckpt_dir):
    expected = reference()[0]
    full = torch.load(os.path.join(ckpt_dir, "full.pt"), weights_only=True)
    for stage in (1, 2, 3):
        model, opt = wrap(stage)
        model.load_full_state_dict(full["model"], full["optim"], opt)
        train(model, opt, range(2, STEPS), rank, ws)
        assert_close(model.full_state_dict(), expected, f"full ckpt ws4/stage3 -> ws{ws}/stage{stage}")
        model, opt = wrap(stage)
        model.load_sharded(os.path.join(ckpt_dir, "sharded"), opt)
        train(model, opt, range(2, STEPS), rank, ws)
        assert_close(model.full_state_dict(), expected, f"sharded ckpt ws4/stage3 -> ws{ws}/stage{stage}")


def _sharded_same_size_and_crash(rank, ws, tmp):
    expected = reference()[0]
    good, other = os.path.join(tmp, "good"), os.path.join(tmp, "other")
    model, opt = wrap(2)
    train(model, opt, range(2), rank, ws)
    model.save_sharded(good, opt)
    model.save_sharded(other, opt)
    # A rank that fails mid-write: every rank raises, the previous files stay loadable.
    real_save = torch.save

    def broken(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full (simulated)")
    torch.save = broken if rank == 1 else real_save
    try:
        train(model, opt, range(2, 3), rank, ws)
        with pytest.raises(RuntimeError, match="previous checkpoint there is intact"):
            model.save_sharded(good, opt)
    finally:
        torch.save = real_save
    assert sorted(os.listdir(good)) == [f"rank{r:05d}-of-{ws:05d}.pt" for r in range(ws)]   # no temp files
    fresh, fresh_opt = wrap(2)
    fresh.load_sharded(good, fresh_opt)
    train(fresh, fresh_opt, range(2, STEPS), rank, ws)
    assert_close(fresh.full_state_dict(), expected, "sharded ckpt after a failed save")
    # Files of two different saves are refused.
    pynccl.barrier()
    if rank == 0:
        os.replace(os.path.join(other, f"rank00001-of-{ws:05d}.pt"), os.path.join(good, f"rank00001-of-{ws:05d}.pt"))
    pynccl.barrier()
    with pytest.raises(ValueError, match="different saves"):
        fresh.load_sharded(good, fresh_opt)


def _errors(rank, ws):
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        pynccl.FullyShardedDataParallel(make_net(), stage=4)
    with pytest.raises(TypeError, match="mixed_precision must be"):
        pynccl.FullyShardedDataParallel(make_net(), stage=1, mixed_precision="bf16")
    with pytest.raises(ValueError, match="wrap_modules only applies to stage 3"):
        pynccl.FullyShardedDataParallel(make_net(), stage=2, wrap_modules=[Block])
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        pynccl.FullyShardedDataParallel(make_net(), stage=2, bucket_cap_mb=0)
    model, opt = wrap(3)
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=1.0)
    with pytest.raises(ValueError, match="not one of this FullyShardedDataParallel"):
        model.full_optim_state_dict(foreign)
    sd = model.full_state_dict()
    assert list(sd) == list(make_net().state_dict()) or sorted(sd) == sorted(make_net().state_dict())
    bad = dict(sd, **{"norm.weight": torch.zeros(D + 1)})
    with pytest.raises(ValueError, match="norm.weight' has shape"):
        model.load_full_state_dict(bad)
    with pytest.raises(KeyError, match="missing keys"):
        model.load_full_state_dict({k: v for k, v in sd.items() if k != "norm.bias"})
    model, opt = wrap(2, unused=True)              # stage 2: an unused parameter is an error...
    model(*local(global_batch(0), rank, ws)).backward()
    with pytest.raises(RuntimeError, match="no gradient for spare.weight"):
        model(*local(global_batch(0), rank, ws))
    model, opt = wrap(3, unused=True)              # ...stage 3 gives it a zero gradient
    model(*local(global_batch(0), rank, ws)).backward()
    assert all(p.grad is not None for p in model.parameters())


def _case(rank, ws, ckpt_dir, tmp):
    _exactness(rank, ws)
    _no_sync_is_silent(rank, ws)
    _mixed_precision(rank, ws)
    if ws == 3:
        _other_optimizers(rank, ws)
    if ws == 4:
        _subgroups(rank, ws)
        _write_checkpoints(rank, ws, ckpt_dir)
    if ws == 2:
        _stage2_overlaps(rank, ws)
        _eval_between_forward_and_backward(rank, ws)
        _resume_elsewhere(rank, ws, ckpt_dir)
        _sharded_same_size_and_crash(rank, ws, tmp)
        _errors(rank, ws)
    return True


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ws4_checkpoint(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("zero_ws4"))
    run_multiprocess(_case, 4, args=(ckpt_dir, ckpt_dir), timeout=240)
    return ckpt_dir


def test_zero_world_size_4(ws4_checkpoint):
    assert os.path.exists(os.path.join(ws4_checkpoint, "full.pt"))


@pytest.mark.numerics
def test_zero_world_size_3(tmp_path):
    assert run_multiprocess(_case, 3, args=(None, str(tmp_path)), timeout=240) == [True] * 3


def test_zero_world_size_2_resumes_ws4_checkpoints(ws4_checkpoint, tmp_path):
    assert run_multiprocess(_case, 2, args=(ws4_checkpoint, str(tmp_path)), timeout=240) == [True] * 2


def test_full_checkpoint_loads_into_plain_model(ws4_checkpoint):
    full = torch.load(os.path.join(ws4_checkpoint, "full.pt"), weights_only=True)
    assert all(isinstance(k, int) for k in full["optim"]["state"])
    resumed, _ = reference(steps=range(2, STEPS), start=full)
    assert_close({k: v for k, (v, _) in resumed.items()}, reference()[0], "plain model resumed from a ws-4 stage-3 checkpoint")
