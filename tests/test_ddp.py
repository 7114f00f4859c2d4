"""pynccl.DistributedDataParallel on gloo against torch DDP and a single-process full-batch run:
parameters after 5 steps of SGD and AdamW, unused / tied / frozen parameters, BatchNorm buffers,
no_sync accumulation, checkpointing, bucket views, comm hooks, errors; SyncBatchNorm against
BatchNorm on the full batch; DistributedSampler; the example under torchrun. One process launch
per world size runs every check (process start costs seconds on two cores)."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pynccl
from pynccl.ddp import hooks as comm_hooks
from pynccl.testing import run_multiprocess
from numerics import assert_within, chain_rtol
from repo_env import subprocess_env
from ddp_common import (FULL_BATCH_RTOL, STEPS, TINY_BUCKETS_MB, BNNet, _assert_params_close,  # noqa: F401
                        _assert_trained_close, _batches, _max_diff, _mlp, _opt, _train, vs_torch_rtol)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- checks

def _train_three(make, opt_name, batches, rank, ws, kw=None, set_to_none=None, accumulate=1, wrap_ours=None):
    """The same model trained on one process on the whole batch (ref), under pynccl DDP (ours) and
    under torch DDP (theirs); returns the three models with their optimizers and gradient scales."""
    kw = kw or {}
    runs = {}
    for side in ("ref", "ours", "theirs"):
        if side == "ref":
            model = make()
        elif side == "ours":
            model = (wrap_ours or (lambda m: pynccl.DistributedDataParallel(m, bucket_cap_mb=TINY_BUCKETS_MB, **kw)))(make())
        else:
            model = TorchDDP(make(), **kw)
        opt, scale = _opt(opt_name, model.parameters()), {}
        r, n = (0, 1) if side == "ref" else (rank, ws)
        _train(model, opt, batches, r, n, accumulate=accumulate, set_to_none=set_to_none, grad_scale=scale)
        runs[side] = (model, opt, scale)
    return runs


def _compare_three(runs, ws, what, against=("theirs", "ref")):
    ours = runs["ours"][0].module.parameters()
    ours = list(ours)
    if "theirs" in against:
        theirs, opt, scale = runs["theirs"]
        _assert_trained_close(ours, theirs.module, opt, scale, vs_torch_rtol(ws), f"{what} vs torch DDP")
    if "ref" in against:
        ref, opt, scale = runs["ref"]
        _assert_trained_close(ours, ref, opt, scale, FULL_BATCH_RTOL, f"{what} vs full batch")


def _check_against_torch_and_reference(rank, ws):
    """SGD without and with momentum (linear in the gradient: a wrong 1/N scale moves every
    parameter by a step's worth) and AdamW (the optimizer users run; scale-invariant)."""
    batches = _batches((6 * ws, 8), (6 * ws, 8))
    # (kwargs, zero_grad(set_to_none=...)): bucket views with grads set to None every step get
    # fresh gradients that the pack moves into the views.
    # NOTE: copies named (pynccl's default is views, torch's copies); dict(): the defaults, views vs copies.
    configs = [(dict(gradient_as_bucket_view=False), True), (dict(gradient_as_bucket_view=True), False), (dict(), True)]
    for opt_name in ("plain-sgd", "sgd", "adamw"):
        for kw, set_to_none in configs + ([(dict(gradient_as_bucket_view=True), True)] if opt_name != "adamw" else []):
            runs = _train_three(_mlp, opt_name, batches, rank, ws, kw, set_to_none)
            ours, theirs = runs["ours"][0], runs["theirs"][0]
            assert len(ours.reducer.bucketer.buckets) > 2
            _compare_three(runs, ws, f"{opt_name} {kw} set_to_none={set_to_none}")
            assert ours.reducer.rebuilt, "buckets were not rebuilt after the first iteration"
            assert ours.module.frozen.weight.grad is None
            if ours.gradient_as_bucket_view:
                for b in ours.reducer.bucketer.buckets:
                    for p, v in zip(b.params, b.views()):
                        assert p.grad.data_ptr() == v.data_ptr(), "grad is not a view of its bucket"
    return ours, theirs


def _check_state_dict_and_broadcast(rank, ws, ours, theirs):
    assert list(ours.state_dict().keys()) == list(theirs.state_dict().keys())
    assert all(k.startswith("module.") for k in ours.state_dict())
    # Rank 0's parameters and buffers win at construction.
    model = BNNet()
    with torch.no_grad():
        for t in list(model.parameters()) + [model.bn.running_mean]:
            t.fill_(float(rank))
    ddp = pynccl.DistributedDataParallel(model)
    assert all(torch.all(t == 0) for t in list(model.parameters()) + [model.bn.running_mean])


def _check_buffers_accumulation_checkpoint(rank, ws):
    batches = _batches((4 * ws, 3, 5), (4 * ws, 4), seed=2)

    def bn_model():
        torch.manual_seed(3)
        return BNNet()

    # BatchNorm's batch statistics are per rank (as torch DDP's): compared with torch DDP only.
    for opt_name in ("plain-sgd", "adamw"):
        runs = _train_three(bn_model, opt_name, batches, rank, ws)
        _compare_three(runs, ws, f"BatchNorm {opt_name}", against=("theirs",))
        assert runs["ours"][0].module.bn.num_batches_tracked.item() == STEPS
    # broadcast_buffers: each forward starts from rank 0's running stats. Two forwards without an
    # optimizer step (the same weights, kernels and data on both sides): bitwise torch DDP's.
    ours = pynccl.DistributedDataParallel(bn_model(), bucket_cap_mb=TINY_BUCKETS_MB)
    theirs = TorchDDP(bn_model())
    for m in (ours, theirs):
        for x, _ in batches[:2]:
            m(x.chunk(ws)[rank]).sum().backward()
    _assert_params_close(ours.module.buffers(), theirs.module.buffers(), "BatchNorm buffers (broadcast_buffers)", 0.0)
    first = BNNet.__new__(BNNet)
    nn.Module.__init__(first)
    first.bn = nn.BatchNorm1d(6)
    with torch.no_grad():      # rank 0's stats after its first batch, then this rank's second batch
        y0 = ours.module.conv(batches[0][0].chunk(ws)[0])
        first.bn.train()(y0)
        first.bn(ours.module.conv(batches[1][0].chunk(ws)[rank]))
    assert torch.equal(first.bn.running_mean, ours.module.bn.running_mean), "broadcast_buffers: not rank 0's stats"

    # no_sync: 2 micro-batches per step; equals torch DDP and the full batch.
    batches = _batches((8 * ws, 8), (8 * ws, 8), seed=3)
    for opt_name in ("plain-sgd", "sgd"):
        for kw in (dict(gradient_as_bucket_view=False), dict(gradient_as_bucket_view=True)):
            runs = _train_three(_mlp, opt_name, batches, rank, ws, kw, accumulate=2)
            _compare_three(runs, ws, f"no_sync {opt_name} {kw}")

    # Non-reentrant activation checkpointing.
    runs = _train_three(lambda: _mlp(checkpoint=True), "adamw", batches, rank, ws)
    _compare_three(runs, ws, "checkpoint adamw", against=("ref",))


def _check_unused(rank, ws):
    batches = _batches((4 * ws, 8), (4 * ws, 8), seed=4)
    # `extra` is used on rank 0 only: locally unused elsewhere, globally used.
    for opt_name in ("plain-sgd", "sgd"):
        for kw in (dict(find_unused_parameters=True), dict(find_unused_parameters=True, gradient_as_bucket_view=True),
                   dict(static_graph=True)):
            def make():
                return _mlp(extra_ranks=(0,), with_never=True)
            # The forward differs per rank (`extra`): torch DDP is the reference, not one process.
            runs = _train_three(make, opt_name, batches, rank, ws, kw)
            _compare_three(runs, ws, f"unused {opt_name} {kw}", against=("theirs",))
            ours, theirs = runs["ours"][0], runs["theirs"][0]
            for name, p in ours.module.named_parameters():
                q = dict(theirs.module.named_parameters())[name]
                assert (p.grad is None) == (q.grad is None), f"{kw}: {name} grad None-ness differs from torch"
                if p.grad is not None:
                    assert_within(p.grad, q.grad, vs_torch_rtol(ws) * q.grad.abs().max().item(),
                                  f"{kw}: {name} grad vs torch DDP")
            assert ours.module.never.weight.grad is None
            assert ours.module.extra.weight.grad is not None        # globally used: reduced grad on every rank
    if kw.get("static_graph"):
        assert ours.reducer.static_unused is not None

    # Without find_unused_parameters: a clear error at the next forward, naming the parameters.
    ddp = pynccl.DistributedDataParallel(_mlp(with_never=True), bucket_cap_mb=TINY_BUCKETS_MB)
    x = torch.randn(4, 8)
    ddp(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"(?s)finished reduction in the prior iteration.*"
                                           r"find_unused_parameters=True.*never\.weight, never\.bias"):
        ddp(x)
    ddp.module.uses_never = True
    ddp(x).sum().backward()                # the error reset the state; all parameters used now
    ddp(x)


def _grads(model):
    return [p.grad for p in getattr(model, "module", model).parameters() if p.requires_grad]


def _check_hooks_against_torch(rank, ws):
    """Torch's semantics for comm hooks: a bucket reaches the hook NOT divided by world size, so
    torch's own stock hooks (which divide themselves) run unchanged, and pynccl's built-in hooks
    (fused: 1/N in the pack) give what torch's give. Each pynccl DDP + hook is compared with torch
    DDP + torch's same hook on the same data: gradients after one backward, then parameters after
    5 steps of SGD (without and with momentum) and of AdamW. A bucket pre-divided by N would be off
    by a factor of N."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    batches = _batches((4 * ws, 8), (4 * ws, 8), seed=5)
    x, y = batches[0][0].chunk(ws)[rank], batches[0][1].chunk(ws)[rank]

    def psgd_state():
        # One bucket each side (default caps): the same tensors in the same order share one seed.
        return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                           min_compression_rate=0.5, random_seed=0)

    # (name, pynccl hook, torch hook, gradient tolerance in ulps of the largest gradient of each
    # tensor in (the wire's mantissa bits, ulps)). fp32: the same sums up to fp32 rounding.
    # fp16/bf16: the bucket layouts differ (torch keeps registration order inside a bucket), so gloo
    # adds the 3 ranks' wire values in another order (2 ulps); pynccl's fused hooks also scale
    # before the cast, torch's after it (4 ulps). Parameters after 5 steps: within what gradients
    # that far apart allow (_assert_trained_close); against the fp32 full batch, the wire's cast,
    # its sum of ws values and the scale ((ws + 2) ulps) on top of the full batch's fp32 rounding.
    # A factor of N is far outside all.
    fp32, fp16, bf16 = (23, 8), 10, 7
    cases = [("torch allreduce_hook", default_hooks.allreduce_hook, default_hooks.allreduce_hook, fp32),
             ("torch fp16_compress_hook", default_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook,
              (fp16, 2)),
             ("torch bf16_compress_hook", default_hooks.bf16_compress_hook, default_hooks.bf16_compress_hook,
              (bf16, 2)),
             ("pynccl allreduce_hook", comm_hooks.allreduce_hook, None, fp32),
             ("pynccl fp16_compress_hook", comm_hooks.fp16_compress_hook, default_hooks.fp16_compress_hook,
              (fp16, 4)),
             ("pynccl bf16_compress_hook", comm_hooks.bf16_compress_hook, default_hooks.bf16_compress_hook,
              (bf16, 4)),
             ("torch powerSGD_hook", powerSGD_hook.powerSGD_hook, powerSGD_hook.powerSGD_hook, fp32)]
    for name, our_hook, their_hook, (mantissa_bits, num_ulps) in cases:
        stateful = their_hook is powerSGD_hook.powerSGD_hook
        rtol = num_ulps * 2.0 ** -mantissa_bits

        def wrap_ours(m):
            # PowerSGD: one bucket each side (default caps), whose matrices share one seed.
            ddp = pynccl.DistributedDataParallel(m, bucket_cap_mb=None if stateful else TINY_BUCKETS_MB)
            ddp.register_comm_hook(psgd_state() if stateful else None, our_hook)
            return ddp

        def wrap_theirs(m):
            ddp = TorchDDP(m)
            if their_hook is not None:
                ddp.register_comm_hook(psgd_state() if stateful else None, their_hook)
            return ddp
        ours, theirs = wrap_ours(_mlp()), wrap_theirs(_mlp())
        for m in (ours, theirs):
            ((m(x) - y) ** 2).mean().backward()
        for g, e in zip(_grads(ours), _grads(theirs)):
            d, top = (g - e).abs().max().item(), e.abs().max().item()
            ulp = 2.0 ** (math.floor(math.log2(top)) - mantissa_bits)
            assert d <= num_ulps * ulp, \
                f"{name}: gradients vs torch DDP: max |diff| {d:.3g} > {num_ulps} ulps of {top:.3g}"
        for opt_name in ("plain-sgd", "sgd", "adamw"):
            runs = {}
            for side, model in (("ours", wrap_ours(_mlp())), ("theirs", wrap_theirs(_mlp())), ("ref", _mlp())):
                opt, scale = _opt(opt_name, model.parameters()), {}
                _train(model, opt, batches, *((rank, ws) if side != "ref" else (0, 1)), grad_scale=scale)
                runs[side] = (model, opt, scale)
            ours_params = list(runs["ours"][0].module.parameters())
            _assert_trained_close(ours_params, runs["theirs"][0].module, *runs["theirs"][1:], max(rtol, vs_torch_rtol(ws)),
                                  f"{name}: {opt_name} parameters vs torch DDP")
            if opt_name != "adamw" and "compress" in name:   # the compression is real, and close to fp32
                wire_rtol = (ws + 2) * 2.0 ** -mantissa_bits + FULL_BATCH_RTOL
                _assert_trained_close(ours_params, runs["ref"][0], *runs["ref"][1:], wire_rtol,
                                      f"{name}: {opt_name} vs fp32 full batch")
                assert _max_diff(ours_params, runs["ref"][0].parameters()) > 0, name
    ours = pynccl.DistributedDataParallel(_mlp(), bucket_cap_mb=TINY_BUCKETS_MB)
    ours.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    assert ours.reducer.bucketer.buckets[0].extra["wire"].dtype == torch.bfloat16   # the fused cast


def _check_hooks_and_errors(rank, ws):
    _check_hooks_against_torch(rank, ws)

    # A custom hook: sees the bucket not divided by world size (torch's semantics), may return a new tensor.
    seen = []

    def double_hook(state, bucket):
        # Overlap: the first bucket's reduction starts while backward still produces gradients.
        bk = ddp.reducer.bucketer
        seen.append((bucket.index(), bucket.is_last(), bk.in_backward, sum(bk._ready) < len(bk.params)))
        out = bucket.buffer() * 2
        work = pynccl.all_reduce(out, group=state, async_op=True)
        return comm_hooks._Pending(work, out)

    ddp = pynccl.DistributedDataParallel(_mlp(), bucket_cap_mb=TINY_BUCKETS_MB)
    ddp.register_comm_hook(None, double_hook)
    x = torch.randn(2 * ws, 8, generator=torch.Generator().manual_seed(9))
    ddp(x.chunk(ws)[rank]).sum().backward()
    plain = _mlp()
    plain(x).sum().backward()            # sum over the full batch = the SUM of the per-rank sums
    for p, q in zip(ddp.module.parameters(), plain.parameters()):
        if q.grad is not None:
            assert_within(p.grad, 2 * q.grad, FULL_BATCH_RTOL * 2 * q.grad.abs().max().item(), "custom hook: grad")
    assert [s[0] for s in seen] == list(range(len(seen))) and seen[-1][1]
    assert all(s[2] for s in seen) and seen[0][3], seen
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, comm_hooks.allreduce_hook)

    # a torch group is accepted, as the pynccl group of its ranks (issue #17); anything else is not
    assert pynccl.DistributedDataParallel(_mlp(), process_group=tdist.group.WORLD).process_group \
        is pynccl.get_default_group()
    with pytest.raises(TypeError, match="pynccl ProcessGroup"):
        pynccl.DistributedDataParallel(_mlp(), process_group="world")
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        pynccl.DistributedDataParallel(_mlp(), bucket_cap_mb=-1)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        pynccl.DistributedDataParallel(lambda x: x)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        pynccl.DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(ValueError, match="device_ids"):
        pynccl.DistributedDataParallel(_mlp(), device_ids=[3])
    odd = nn.Linear(2, 2 + (rank == ws - 1))
    with pytest.raises(ValueError, match="model differs across ranks"):
        pynccl.DistributedDataParallel(odd)


def _check_sync_batchnorm(rank, ws):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4 * ws, 5, 6, 3, generator=g) * 3 + 10       # a large mean tests the stats' accuracy
    dy = torch.randn(4 * ws, 5, 6, 3, generator=g)
    ref = nn.BatchNorm2d(5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=g)
        ref.bias.uniform_(-1, 1, generator=g)
    sync = pynccl.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(5)))[0]
    assert isinstance(sync, pynccl.SyncBatchNorm)
    sync.load_state_dict(ref.state_dict())
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    xs = x.chunk(ws)[rank].clone().requires_grad_()
    y = sync(xs)
    y.backward(dy.chunk(ws)[rank])
    ref_y = nn.functional.batch_norm(x, None, None, ref.weight.detach(), ref.bias.detach(), True)
    # Statistics over N elements per channel: the mean's rounding, N·eps·max|x|, against the σ
    # normalising divides by (|x| reaches 10 + 4σ here); the variance, per rank in two passes and
    # combined over ranks in fp64 as Chan et al. do (well conditioned), N·eps·σ²: relative to the
    # outputs N·eps·max|x| / σ (tests/numerics.py). Local-only statistics are off by ~σ/sqrt(N/ws).
    n = x.numel() // x.shape[1]
    rtol = chain_rtol(n) * (x.abs().max() / x.std()).item()

    def close(actual, expected, what, extra=0.0):
        assert_within(actual, expected, (rtol + extra) * expected.abs().max().item(), f"SyncBatchNorm {what}")
    close(y.detach(), ref_y.chunk(ws)[rank], "output")
    close(xs.grad, xr.grad.chunk(ws)[rank], "input grad")
    # weight/bias grads are local sums: summed over ranks they are the full batch's (+ that sum's order).
    for p, q in ((sync.weight, ref.weight), (sync.bias, ref.bias)):
        total = p.grad.clone()
        pynccl.all_reduce(total)
        close(total, q.grad, "weight/bias grad", chain_rtol(ws + 1))
    close(sync.running_mean, ref.running_mean, "running_mean")
    close(sync.running_var, ref.running_var, "running_var")
    assert sync.num_batches_tracked.item() == 1
    sync.eval()
    close(sync(xs.detach()), ref.eval()(x.chunk(ws)[rank]), "eval output")
    with pytest.raises(ValueError, match="expected 5"):
        sync(torch.randn(2, 4, 3))


def _check_sampler(rank, ws):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    ds = TensorDataset(torch.arange(10))
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    mine = [int(v) for (batch,) in DataLoader(ds, sampler=sampler, batch_size=2) for v in batch]
    everyone = [None] * ws
    pynccl.all_gather_object(everyone, mine)
    flat = [i for part in everyone for i in part]
    assert len(mine) == -(-10 // ws) and set(flat) == set(range(10))


def _check_subgroup(rank, ws):
    """DDP over a pynccl sub-group that leaves rank 1 out: group rank 0 is the broadcast root,
    hooks reduce over the group only; equals the full batch of the members' data."""
    members = [0, ws - 1]
    sub = pynccl.new_group(members)
    if rank not in members:
        return
    batches = _batches((12, 8), (12, 8), seed=6)
    ref = _mlp()
    _train(ref, _opt("adamw", ref.parameters()), batches, 0, 1)
    model = _mlp()
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)                       # rank 0's parameters must win at construction
    ours = pynccl.DistributedDataParallel(model, process_group=sub, bucket_cap_mb=TINY_BUCKETS_MB)
    _train(ours, _opt("adamw", ours.parameters()), batches, members.index(rank), len(members))
    _assert_params_close(ours.module.parameters(), ref.parameters(), "sub-group DDP vs full batch")


def _case_torch_first(rank, ws):
    """The script initialised torch.distributed only: DDP bootstraps pynccl from it."""
    tdist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        assert not pynccl.is_initialized()
        ours, theirs = _check_against_torch_and_reference(rank, ws)
        assert pynccl.is_initialized() and pynccl.get_backend() == "gloo"
        _check_state_dict_and_broadcast(rank, ws, ours, theirs)
        _check_buffers_accumulation_checkpoint(rank, ws)
        _check_unused(rank, ws)
        _check_hooks_and_errors(rank, ws)
        _check_sync_batchnorm(rank, ws)
    finally:
        pynccl.destroy_process_group()
        tdist.destroy_process_group()


def _case_pynccl_first(rank, ws):
    """The script called pynccl.init_process_group only (torch DDP rides its gloo default group)."""
    ours, theirs = _check_against_torch_and_reference(rank, ws)
    _check_state_dict_and_broadcast(rank, ws, ours, theirs)
    _check_buffers_accumulation_checkpoint(rank, ws)
    _check_unused(rank, ws)
    _check_hooks_and_errors(rank, ws)
    _check_sync_batchnorm(rank, ws)
    _check_sampler(rank, ws)
    _check_subgroup(rank, ws)


def test_ddp_world_size_2_bootstrapped_from_torch_distributed():
    run_multiprocess(_case_torch_first, 2, backend=None, timeout=120)


@pytest.mark.numerics
def test_ddp_world_size_3():
    run_multiprocess(_case_pynccl_first, 3, backend="gloo", timeout=120)


def _double_scaled_hook(state, bucket):
    """A mutant of torch's allreduce_hook: divides by the world size twice (a doubled 1/N)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    bucket.buffer().div_(pynccl.get_world_size())
    return default_hooks.allreduce_hook(state, bucket)


def _check_mutant_fails(rank, ws):
    """The bounds above catch a doubled 1/N under SGD without momentum (and AdamW would not:
    its step ignores the gradient's scale, which is why every path is compared under SGD)."""
    batches = _batches((6 * ws, 8), (6 * ws, 8))

    def wrap(m):
        ddp = pynccl.DistributedDataParallel(m, bucket_cap_mb=TINY_BUCKETS_MB)
        ddp.register_comm_hook(None, _double_scaled_hook)
        return ddp
    runs = _train_three(_mlp, "plain-sgd", batches, rank, ws, wrap_ours=wrap)
    with pytest.raises(AssertionError, match="vs torch DDP: parameter"):
        _compare_three(runs, ws, "doubled 1/N", against=("theirs",))
    return True


def test_a_wrong_scale_fails_the_bounds():
    assert run_multiprocess(_check_mutant_fails, 2, backend="gloo", timeout=120) == [True, True]


def test_example_runs_under_torchrun():
    env = subprocess_env(OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["CUDA_VISIBLE_DEVICES"] = ""                    # gloo on CPU even on a GPU machine
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(REPO, "examples", "train_ddp.py"), "--epochs", "2", "--samples", "256"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(line.split("loss")[1].split()[0]) for line in proc.stdout.splitlines() if "epoch" in line]
    assert len(losses) == 2 and losses[-1] < losses[0], proc.stdout
