"""Pipeline parallelism on gloo against a single-process run on the whole batch: for GPipe and
1F1B at p = 2, 3, 4 and m = 1, p, 2p, 8, the mean of the micro-batch losses and every parameter
gradient match within the fp32 rounding of the model's reductions (tests/numerics.py; SGD
parameters within what that allows), and each rank holds at most the schedule's bound of
micro-batch activations. One process launch per p runs every check (the split helper, metadata
encoding and neighbour exchange are in test_pipeline_units.py)."""
import contextlib
import copy

import pytest
import torch
from torch import nn

import pynccl
from pynccl.ddp.hooks import allreduce_hook
from pynccl.mesh import ParallelMesh
from pynccl.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                             build_programs, build_stage_module, check, split_into_stages)
from pynccl.testing import run_multiprocess
from numerics import chain_rtol, eps, sgd_atol

WIDTH = 8
# Relative to each tensor's (or the loss's) largest value: the 8 layers 8 wide, forward and
# backward; the MSE's mean over at most 48 × 8 outputs; each weight gradient's sum over 48 rows.
TOL = chain_rtol(2 * 8 * WIDTH, 48 * WIDTH, 48)
mse = nn.functional.mse_loss


# ----------------------------------------------------------------------------- helpers
def _model(seed=0, depth=8):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _data(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g)


def _reference(model, x, y, loss_fn=mse):
    """A copy of model after forward+backward on the whole batch, its loss and its output."""
    ref = copy.deepcopy(model)
    out = ref(x)
    loss = loss_fn(out, y)
    loss.backward()
    return ref, loss.detach(), out.detach()


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _assert_grads(stage_mod, ref_layers, what):
    ref_params = [p for layer in ref_layers for p in layer.parameters()]
    params = list(stage_mod.parameters())
    assert len(params) == len(ref_params), what
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert p.grad is not None, f"{what}: parameter {i} has no gradient"
        d, bound = _max_diff(p.grad, q.grad), TOL * q.grad.abs().max().item()
        assert d <= bound, f"{what}: parameter {i} gradient differs from the reference by {d:.2e} > {bound:.2e}"


def _grad_scale(ref_layers):
    return max(p.grad.abs().max().item() for layer in ref_layers for p in layer.parameters())


def _assert_params(stage_mod, ref_layers, what, steps, momentum, grad_scale, lr=0.5):
    """After `steps` SGD steps on gradients TOL of grad_scale apart (numerics.sgd_atol), plus each
    value's own rounding per update."""
    ref_params = [p for layer in ref_layers for p in layer.parameters()]
    for i, (p, q) in enumerate(zip(stage_mod.parameters(), ref_params)):
        d = _max_diff(p.detach(), q.detach())
        bound = sgd_atol(lr, steps, TOL * grad_scale, momentum) + steps * eps() * q.detach().abs().max().item()
        assert d <= bound, f"{what}: parameter {i} differs from the reference by {d:.2e} > {bound:.2e}"


def _assert_loss(got, expected, what):
    d, bound = abs(got - expected), TOL * abs(expected)
    assert d <= bound, f"{what}: mean micro-batch loss differs from the whole-batch loss by {d:.2e} > {bound:.2e}"


def _assert_step(rank, p, out, losses, m, ref_loss, ref_out, what):
    if rank != p - 1:
        assert out is None and losses == [], what
        return
    assert len(losses) == m, what
    _assert_loss(torch.stack(losses).mean().item(), ref_loss.item(), what)
    assert _max_diff(out, ref_out) <= TOL * ref_out.abs().max().item(), f"{what}: merged output differs from the reference"


# ----------------------------------------------------------------------------- multi-process checks
def _check_schedules(rank, p):
    """GPipe and 1F1B, m in {1, p, 2p, 8}: losses, gradients, peak activations, programs."""
    batch = 24 if p == 3 else 8
    x, y = _data(batch, seed=1)
    full = _model()
    ref, ref_loss, ref_out = _reference(full, x, y)
    start, end = split_into_stages(full, p)[rank]
    mod = build_stage_module(full, rank, p)
    stage = PipelineStage(mod, rank, p)
    for cls in (ScheduleGPipe, Schedule1F1B):
        for m in sorted({1, p, 2 * p, 8}):
            what = f"{cls.__name__} p={p} m={m} rank {rank}"
            mod.zero_grad(set_to_none=True)
            sched = cls(stage, m, mse)
            assert sched.program == build_programs(sched.kind, p, m)[rank], what
            losses = []
            out = sched.step(x, target=y, losses=losses)
            _assert_step(rank, p, out, losses, m, ref_loss, ref_out, what)
            _assert_grads(mod, list(ref)[start:end], what)
            bound = m if cls is ScheduleGPipe else min(p - rank, m)
            assert stage.peak_live_activations == sched.peak_live_activations == bound, \
                f"{what}: peak live activations {stage.peak_live_activations}, expected {bound}"
            assert stage.num_live_activations == 0
            assert check(sched.kind, p, m).peak_live[rank] == bound

    # scale_grads=False with a sum-reduced loss: gradients of the whole batch's sum.
    sum_loss = lambda o, t: mse(o, t, reduction="sum")  # noqa: E731
    ref_sum, ref_sum_loss, _ = _reference(full, x, y, sum_loss)
    mod.zero_grad(set_to_none=True)
    losses = []
    Schedule1F1B(stage, p, sum_loss, scale_grads=False).step(x, target=y, losses=losses)
    for a, b in zip(mod.parameters(), [q for layer in list(ref_sum)[start:end] for q in layer.parameters()]):
        assert _max_diff(a.grad, b.grad) <= TOL * b.grad.abs().max().item()
    if rank == p - 1:
        _assert_loss(torch.stack(losses).sum().item(), ref_sum_loss.item(), "scale_grads=False, summed loss")


def _check_training(rank, p):
    """Optimizer steps with batch sizes changing between steps: parameters follow the
    reference, and shape metadata is sent only when the shapes change."""
    base = 24 if p == 3 else 8
    full = _model(seed=3)
    ref = copy.deepcopy(full)
    start, end = split_into_stages(full, p)[rank]
    mod = build_stage_module(full, rank, p)
    sched = Schedule1F1B(PipelineStage(mod, rank, p), p, mse)
    opt = torch.optim.SGD(mod.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    scale = 0.0
    for it, batch in enumerate((base, base, 2 * base, 2 * base, base)):
        x, y = _data(batch, seed=10 + it)
        opt.zero_grad()
        losses = []
        sched.step(x, target=y, losses=losses)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        scale = max(scale, _grad_scale(list(ref)))
        ref_opt.step()
        _assert_params(mod, list(ref)[start:end], f"training p={p} step {it} rank {rank}", it + 1, 0.9, scale)
        if rank == p - 1:
            _assert_loss(torch.stack(losses).mean().item(), ref_loss.item(), f"training p={p} step {it}")
    expected_meta = 3 if rank < p - 1 else 0     # steps 0, 2 and 4 change the shapes
    assert sched._transport.num_meta_sent == expected_meta, (rank, sched._transport.num_meta_sent)


def _check_interleaved(rank, p, v, ms):
    """Several stages per rank (stage k on rank k % p): gradients and peak activations."""
    num_stages = p * v
    batch = 24 if p == 3 else 8
    x, y = _data(batch, seed=4)
    full = _model(depth=max(8, num_stages))
    ref, ref_loss, ref_out = _reference(full, x, y)
    ranges = split_into_stages(full, num_stages)
    mine = list(range(rank, num_stages, p))
    mods = {k: build_stage_module(full, k, num_stages) for k in mine}
    stages = [PipelineStage(mods[k], k, num_stages) for k in mine]
    for m in ms:
        what = f"interleaved p={p} v={v} m={m} rank {rank}"
        for mod in mods.values():
            mod.zero_grad(set_to_none=True)
        sched = ScheduleInterleaved1F1B(stages, m, mse)
        losses = []
        out = sched.step(x, target=y, losses=losses)
        _assert_step(rank, p, out, losses, m, ref_loss, ref_out, what)
        for k in mine:
            _assert_grads(mods[k], list(ref)[slice(*ranges[k])], f"{what} stage {k}")
        assert sched.peak_live_activations == check(sched.kind, p, m, v).peak_live[rank], what


class _ReduceAtBackward(nn.Module):
    """A data-parallel wrapper of the other kind PipelineStage accepts: no_sync() decides at
    backward time; outside it, each gradient is averaged over dp_group once it is complete."""

    def __init__(self, module, dp_group):
        super().__init__()
        self.module, self.dp_group, self.sync, self.num_reduced = module, dp_group, True, 0
        for prm in module.parameters():
            prm.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, prm):
        if self.sync:
            pynccl.all_reduce(prm.grad, op=pynccl.ReduceOp.AVG, group=self.dp_group)
            self.num_reduced += 1

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def forward(self, *args):
        return self.module(*args)


def _check_data_parallel(rank, world_size):
    """pp=2 × dp=2 from a ParallelMesh, each stage wrapped in pynccl.DistributedDataParallel over
    dp_group: each replica pipelines its half of the batch; after two optimizer steps the
    gradients and parameters equal the whole batch's (one reduction per step, not per micro-batch)."""
    mesh = ParallelMesh(dp=2, pp=2)
    full = _model(seed=6)
    start, end = split_into_stages(full, 2)[mesh.pp_rank]
    half = slice(8 * mesh.dp_rank, 8 * mesh.dp_rank + 8)
    for cls in (ScheduleGPipe, Schedule1F1B):
        ref = copy.deepcopy(full)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        mod = build_stage_module(copy.deepcopy(full), mesh.pp_rank, 2)
        ddp = pynccl.DistributedDataParallel(mod, process_group=mesh.dp_group, bucket_cap_mb=0.0005)
        reduced = []

        def counting_hook(state, bucket):
            reduced.append(bucket.index())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(mesh.dp_group, counting_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        sched = cls(PipelineStage(ddp, mesh.pp_rank, 2, group=mesh.pp_group), 4, mse)
        scale = 0.0
        for it in range(2):
            x, y = _data(16, seed=5 + it)
            opt.zero_grad()
            reduced.clear()
            sched.step(x[half], target=y[half])
            assert reduced and len(reduced) == len(set(reduced)), f"each bucket once per step, got {reduced}"
            ref_opt.zero_grad()
            mse(ref(x), y).backward()
            _assert_grads(mod, list(ref)[start:end], f"DDP × pp {cls.__name__} step {it} rank {rank}")
            scale = max(scale, _grad_scale(list(ref)))
            opt.step()
            ref_opt.step()
            _assert_params(mod, list(ref)[start:end], f"DDP × pp {cls.__name__} step {it} rank {rank}", it + 1, 0.0,
                           scale)
    # A wrapper that decides at backward time: reduced exactly once per parameter per step.
    x, y = _data(16, seed=5)
    ref, _, _ = _reference(full, x, y)
    mod = build_stage_module(copy.deepcopy(full), mesh.pp_rank, 2)
    wrapped = _ReduceAtBackward(mod, mesh.dp_group)
    Schedule1F1B(PipelineStage(wrapped, mesh.pp_rank, 2, group=mesh.pp_group), 4, mse).step(x[half], target=y[half])
    assert wrapped.num_reduced == len(list(mod.parameters())), wrapped.num_reduced
    _assert_grads(mod, list(ref)[start:end], f"backward-time wrapper × pp rank {rank}")
    with pytest.raises(TypeError, match="not torch.nn.parallel.DistributedDataParallel"):
        PipelineStage(nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel),
                      mesh.pp_rank, 2, group=mesh.pp_group)


def _check_single_stage_groups(rank, world_size):
    """p = 1 (no messages at all) on a group of one rank, and interleaved with both stages on one
    rank (hand-offs without messages); a failed step makes the schedule refuse to go on."""
    groups = [pynccl.new_group([r]) for r in range(world_size)]
    own = groups[rank]
    x, y = _data(8, seed=7)
    full = _model()
    ref, ref_loss, ref_out = _reference(full, x, y)
    for cls in (ScheduleGPipe, Schedule1F1B):
        mod = copy.deepcopy(full)
        losses = []
        out = cls(PipelineStage(mod, 0, 1, group=own), 4, mse).step(x, target=y, losses=losses)
        _assert_step(0, 1, out, losses, 4, ref_loss, ref_out, f"p=1 {cls.__name__}")
        _assert_grads(mod, list(ref), f"p=1 {cls.__name__}")
    mods = [build_stage_module(copy.deepcopy(full), k, 2) for k in range(2)]
    sched = ScheduleInterleaved1F1B([PipelineStage(mods[k], k, 2, group=own) for k in range(2)], 4, mse)
    sched.step(x, target=y)
    ranges = split_into_stages(full, 2)
    for k in range(2):
        _assert_grads(mods[k], list(ref)[slice(*ranges[k])], f"p=1 v=2 stage {k}")
    bad = Schedule1F1B(PipelineStage(copy.deepcopy(full), 0, 1, group=own), 2, lambda o, t: (o - t) ** 2)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        bad.step(x, target=y)
    with pytest.raises(RuntimeError, match="a previous step failed"):
        bad.step(x, target=y)


def _check_errors(rank, p):
    mod = _model()
    with pytest.raises(ValueError, match=f"stage {1 - rank} belongs to pp rank {1 - rank}"):
        PipelineStage(mod, 1 - rank, p)
    with pytest.raises(ValueError, match="multiple of the pipeline group's size"):
        PipelineStage(mod, rank, 3)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        PipelineStage(lambda x: x, rank, p)
    with pytest.raises(ValueError, match="stage_index < num_stages"):
        PipelineStage(mod, 5, p)
    with pytest.raises(ValueError, match="the stage computes on meta but the module has parameters on cpu"):
        PipelineStage(mod, rank, p, device="meta")
    stage = PipelineStage(mod, rank, p)
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        Schedule1F1B(stage, 0, mse)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ScheduleGPipe(stage, 2, "mse")
    with pytest.raises(ValueError, match="num_stages=4"):
        ScheduleGPipe(PipelineStage(mod, rank, 4), 2, mse)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        ScheduleInterleaved1F1B([PipelineStage(mod, rank, 4), PipelineStage(mod, rank + 2, 4)], 3, mse)
    with pytest.raises(ValueError, match=r"must hold stages \[%d, %d\]" % (rank, rank + 2)):
        ScheduleInterleaved1F1B([PipelineStage(mod, rank, 4), PipelineStage(mod, rank, 4)], 2, mse)
    sched = Schedule1F1B(stage, 2, mse)
    x, y = _data(8, seed=8)
    # Rejected before any message, so the ranks stay in step and the schedule stays usable.
    if rank == 0:
        with pytest.raises(ValueError, match="must divide evenly into n_microbatches=2"):
            sched.step(x[:7])
        with pytest.raises(ValueError, match="needs its inputs"):
            sched.step(target=y)
    else:
        with pytest.raises(ValueError, match="needs target="):
            sched.step(x)
        with pytest.raises(TypeError, match="losses must be a list"):
            sched.step(x, target=y, losses=())
    sched.step(x, target=y)


def _pipeline_case(rank, world_size):
    p = world_size
    _check_schedules(rank, p)
    _check_training(rank, p)
    if p == 2:
        _check_errors(rank, p)
        _check_single_stage_groups(rank, world_size)
        _check_interleaved(rank, p, 2, (2, 4, 8))
    if p == 3:
        _check_tuple_outputs(rank, p)
        _check_interleaved(rank, p, 2, (3, 6))
    if p == 4:
        _check_interleaved(rank, p, 2, (4, 8))
        _check_data_parallel(rank, world_size)
    return True


# ----------------------------------------------------------------------------- tuple outputs, dtypes
class _Front(nn.Module):
    """x -> (float32 hidden, int64 per-sample flag)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.lin(x)), (x[:, 0] > 0).long()


class _Middle(nn.Module):
    """(float32, int64) -> (float64 hidden, float32 tensor that the last stage ignores)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH).double()

    def forward(self, h, flag):
        return torch.tanh(self.lin(h.double())) + 0.1 * flag.unsqueeze(1).double(), h * 2


class _Back(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h64, unused):
        return self.lin(h64.float())


def _check_tuple_outputs(rank, p):
    """Stages exchanging tuples with int64 and float64 tensors, and an output the next stage
    ignores (its gradient comes back as zeros)."""
    torch.manual_seed(9)
    parts = [_Front(), _Middle(), _Back()]
    x, y = _data(12, seed=9)
    ref = copy.deepcopy(parts)
    loss = mse(ref[2](*ref[1](*ref[0](x))), y)
    loss.backward()
    for cls in (ScheduleGPipe, Schedule1F1B):
        parts[rank].zero_grad(set_to_none=True)
        losses = []
        cls(PipelineStage(parts[rank], rank, p), 3, mse).step(x, target=y, losses=losses)
        _assert_grads(parts[rank], [ref[rank]], f"tuple outputs {cls.__name__} rank {rank}")
        if rank == p - 1:
            _assert_loss(torch.stack(losses).mean().item(), loss.item(), f"tuple outputs {cls.__name__}")


@pytest.mark.numerics
@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_gloo(p):
    assert run_multiprocess(_pipeline_case, p, timeout=120) == [True] * p
