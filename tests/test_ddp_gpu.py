"""pynccl DDP on NCCL: equal to torch DDP (on torch's own NCCL group) at world size 1 on one GPU
and at world size 2+ where there are several GPUs; a whole training step (forward, backward,
bucketed all-reduce, capturable AdamW) captured in a CUDA graph and replayed equals eager."""
import os

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pynccl
from pynccl.ddp import hooks as comm_hooks
from pynccl.testing import run_multiprocess

STEPS = 6
BUCKET_MB = 0.05            # several buckets for this model


SLEEP_CYCLES = 20_000_000  # ~10 ms: widens any stream-ordering race until it fails loudly


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first keeps the stream busy: gradients arrive on the GPU long
    after the host has run every hook, so a pack that does not wait for them reads garbage."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(SLEEP_CYCLES)
        return grad


def _delayed_allreduce_hook(state, bucket):
    """The collective starts late (on the pack stream): the unpack and the optimizer must wait."""
    torch.cuda._sleep(SLEEP_CYCLES // 4)
    return comm_hooks.allreduce_hook(state, bucket)


class Net(nn.Module):
    def __init__(self, slow=False):
        super().__init__()
        self.slow = slow
        self.embed = nn.Linear(32, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 256), nn.GELU(),
                                                  nn.Linear(256, 128)) for _ in range(3))
        self.head = nn.Linear(128, 16)

    def forward(self, x):
        h = self.embed(x)
        for blk in self.blocks:
            h = h + blk(h)
        out = self.head(h)
        return _SlowBackward.apply(out) if self.slow else out


def _build(device, wrap, slow=False, sgd=False, **opt_kw):
    torch.manual_seed(0)
    model = wrap(Net(slow).to(device))
    if sgd:
        return model, torch.optim.SGD(model.parameters(), lr=0.1, **opt_kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **opt_kw)


def _data(rank, ws, device, steps=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = torch.randn(8 * ws, 32, generator=g), torch.randn(8 * ws, 16, generator=g)
        out.append((x.chunk(ws)[rank].to(device), y.chunk(ws)[rank].to(device)))
    return out


def _step(model, opt, x, y, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss


def _params(model):
    return [p.detach().clone() for p in getattr(model, "module", model).parameters()]


def _assert_close(a, b, what, tol=1e-6):
    d = max((p - q).abs().max().item() for p, q in zip(a, b))
    assert d <= tol, f"{what}: max |diff| {d:.3g} > {tol}"


def _max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def _against_torch_ddp(rank, ws):
    """Every case runs, then one assertion lists each case's max |diff| against torch DDP.
    At world size 1 the results are bitwise the same operations (1e-6). Above it, torch's
    communicator and ours may sum a bucket's elements in different orders (NCCL picks the
    algorithm and chunking per call size, and the two DDPs' first buckets differ), so the sums
    differ in the last bits and AdamW's normalised update can carry that over a few steps:
    1e-5 there."""
    device = pynccl.get_device()
    # pynccl's torch.distributed default group is gloo; torch DDP gets its own NCCL group.
    torch_pg = tdist.new_group(backend="nccl")
    data = _data(rank, ws, device)
    tol = 1e-6 if ws == 1 else 1e-5
    diffs = {}
    # (DDP kwargs, slow backward, delayed Python hook). Without a hook of its own a bucket runs
    # as one C++ reduce_bucket call; the delayed hook takes the Python path with the same streams.
    view = dict(gradient_as_bucket_view=True)
    cases = ((dict(), False, False), (view, False, False), (dict(), True, False), (view, True, False),
             (dict(find_unused_parameters=True), True, False), (dict(), True, True), (view, True, True))
    for kw, slow, delayed_hook in cases:
        ours, opt_ours = _build(device, lambda m: pynccl.DistributedDataParallel(
            m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB, **kw), slow)
        theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                               bucket_cap_mb=BUCKET_MB, **kw), slow)
        assert len(ours.reducer.bucketer.buckets) > 2
        if delayed_hook:
            ours.register_comm_hook(None, _delayed_allreduce_hook)
        assert (ours.reducer.fused_comm is None) == delayed_hook
        set_to_none = "gradient_as_bucket_view" not in kw   # bucket views are meant for set_to_none=False
        for x, y in data:
            _step(ours, opt_ours, x, y, set_to_none=set_to_none)
            _step(theirs, opt_theirs, x, y, set_to_none=set_to_none)
        torch.cuda.synchronize()
        name = f"{kw}{' slow backward' if slow else ''}{' delayed Python hook' if delayed_hook else ' one C++ call'}"
        diffs[name] = (_max_diff(_params(ours), _params(theirs)), tol)
        assert ours.reducer.rebuilt == ("find_unused_parameters" not in kw)     # torch's rule

    # Issue 19: torch's own allreduce_hook (it divides by world size itself, so the bucket must
    # arrive undivided), bucket buffers registered with ncclCommRegister, and a communicator made
    # with the efficiency CTA policy and at most 2 CTAs (NCCL >= 2.27): each equal to torch DDP.
    variants = [("torch's allreduce_hook", None, lambda d: d.register_comm_hook(torch_pg, default_hooks.allreduce_hook)),
                ("register_buffers", None, lambda d: setattr(d.reducer, "register_buffers", True))]
    version = pynccl.nccl_version()
    if min(version.build, version.runtime) >= (2, 27, 0):
        env = {"PYNCCL_NCCL_CTA_POLICY": "1", "PYNCCL_NCCL_MIN_CTAS": "1", "PYNCCL_NCCL_MAX_CTAS": "2"}
        os.environ.update(env)
        try:
            cta_group = pynccl.new_group()
        finally:
            for k in env:
                del os.environ[k]
        variants.append(("CTA policy efficiency, maxCTAs 2", cta_group, lambda d: None))
    for name, group, setup in variants:
        ours, opt_ours = _build(device, lambda m: pynccl.DistributedDataParallel(
            m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB, process_group=group), True)
        setup(ours)
        theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                               bucket_cap_mb=BUCKET_MB), True)
        for x, y in data:
            _step(ours, opt_ours, x, y)
            _step(theirs, opt_theirs, x, y)
        torch.cuda.synchronize()
        if name == "register_buffers":
            assert len(ours.reducer._registrations) == len(ours.reducer.bucketer.buckets) > 2
        diffs[name] = (_max_diff(_params(ours), _params(theirs)), tol)

    # bf16 compression: against torch DDP with torch's own bf16 hook (both sum bf16 values, in
    # orders that may differ: a few bf16 roundings apart), and against fp32 torch DDP. SGD, whose
    # update is linear in the gradient (AdamW's first step is lr * sign(g): one sign flip of a
    # near-zero gradient would already be 2 * lr apart).
    ours, opt_ours = _build(device, lambda m: pynccl.DistributedDataParallel(m, bucket_cap_mb=BUCKET_MB), sgd=True)
    ours.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    assert ours.reducer.fused_comm is not None             # a built-in hook: pack casts, unpack casts back
    ref16, opt_ref16 = _build(device, lambda m: TorchDDP(m, process_group=torch_pg, bucket_cap_mb=BUCKET_MB),
                              sgd=True)
    ref16.register_comm_hook(torch_pg, default_hooks.bf16_compress_hook)
    ref, opt_ref = _build(device, lambda m: TorchDDP(m, process_group=torch_pg, bucket_cap_mb=BUCKET_MB), sgd=True)
    for x, y in data:
        _step(ours, opt_ours, x, y)
        _step(ref16, opt_ref16, x, y)
        _step(ref, opt_ref, x, y)
    torch.cuda.synchronize()
    diffs["bf16 hook vs torch DDP's bf16 hook (SGD)"] = (_max_diff(_params(ours), _params(ref16)), 1e-3)
    diffs["bf16 hook vs fp32 torch DDP (SGD)"] = (_max_diff(_params(ours), _params(ref)), 2e-3)
    bad = {k: v for k, v in diffs.items() if not v[0] <= v[1]}
    assert not bad, f"rank {rank}/{ws}: max |diff| against torch DDP over tolerance: " + "; ".join(
        f"{k}: {d:.3g} > {t:g}" for k, (d, t) in bad.items()) + f" (all: {diffs})"

    with pytest.raises(ValueError, match="communicates on cuda"):
        pynccl.DistributedDataParallel(Net())                  # a CPU module on an NCCL group
    return diffs


def _join_against_torch(rank, ws):
    """Uneven inputs on NCCL (rank r has r + 1 batches): `with ddp.join():` ends where torch DDP's
    join ends on the same data, with the default divisor and with divide_by_initial_world_size=False."""
    device = pynccl.get_device()
    torch_pg = tdist.new_group(backend="nccl")
    data = _data(rank, ws, device, steps=ws + 1, seed=3)[:rank + 1]
    for join_kw in (dict(), dict(divide_by_initial_world_size=False)):
        ours, opt_ours = _build(device, lambda m: pynccl.DistributedDataParallel(
            m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB), True)
        theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                               bucket_cap_mb=BUCKET_MB), True)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            with model.join(**join_kw):
                for x, y in data:
                    _step(model, opt, x, y)
        torch.cuda.synchronize()
        _assert_close(_params(ours), _params(theirs), f"join {join_kw} vs torch DDP's join", 1e-5)
    return True


def _torch_nccl_first(rank, ws):
    """The script initialised torch.distributed (nccl) only: DDP bootstraps pynccl's NCCL
    communicator from it; equal to torch DDP on that default group."""
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", rank=rank, world_size=ws, device_id=torch.device("cuda", rank))
    try:
        device = torch.device("cuda", rank)
        ours, opt_ours = _build(device, lambda m: pynccl.DistributedDataParallel(m, device_ids=[rank]))
        assert pynccl.is_initialized() and pynccl.get_backend() == "nccl"
        theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[rank]))
        for x, y in _data(rank, ws, device, steps=3):
            _step(ours, opt_ours, x, y)
            _step(theirs, opt_theirs, x, y)
        _assert_close(_params(ours), _params(theirs), "bootstrapped from torch nccl vs torch DDP")
    finally:
        pynccl.destroy_process_group()
        tdist.destroy_process_group()
    return True


def _graph_vs_eager(rank, ws, static_graph):
    device = pynccl.get_device()
    data = _data(rank, ws, device, steps=8, seed=1)

    def wrap(m):
        return pynccl.DistributedDataParallel(m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB,
                                              static_graph=static_graph)

    eager, opt_eager = _build(device, wrap, capturable=True)
    for x, y in data:
        _step(eager, opt_eager, x, y)

    graphed, opt_graphed = _build(device, wrap, capturable=True)
    # Eager warm-up on a side stream (as torch's docs do): builds, then rebuilds the buckets.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:3]:
            _step(graphed, opt_graphed, x, y)
    torch.cuda.current_stream().wait_stream(side)
    assert graphed.reducer.rebuilt
    static_x, static_y = data[3][0].clone(), data[3][1].clone()
    opt_graphed.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = ((graphed(static_x) - static_y) ** 2).mean()
        loss.backward()
        opt_graphed.step()
    for x, y in data[3:]:                  # capture ran nothing: replay every remaining step
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()
    _assert_close(_params(graphed), _params(eager), f"CUDA graph (static_graph={static_graph}) vs eager")
    return True


def _graph_cases(rank, ws):
    return _graph_vs_eager(rank, ws, False) and _graph_vs_eager(rank, ws, True)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@needs_gpu
def test_ddp_nccl_one_gpu_equals_torch_ddp():
    diffs, = run_multiprocess(_against_torch_ddp, 1, backend="nccl", start_method="spawn", timeout=300)
    print(diffs)


@pytest.mark.gpu
@needs_gpu
def test_ddp_bootstraps_from_torch_nccl():
    assert run_multiprocess(_torch_nccl_first, 1, backend=None, start_method="spawn", timeout=300) == [True]


@pytest.mark.gpu
@needs_gpu
def test_ddp_cuda_graph_step_equals_eager():
    assert run_multiprocess(_graph_cases, 1, backend="nccl", start_method="spawn", timeout=300) == [True]


@pytest.mark.multigpu
@needs_2_gpus
def test_ddp_nccl_multi_gpu_equals_torch_ddp():
    n = min(torch.cuda.device_count(), 4)
    per_rank = run_multiprocess(_against_torch_ddp, n, backend="nccl", start_method="spawn", timeout=300)
    print(per_rank)
    assert len(per_rank) == n


@pytest.mark.multigpu
@needs_2_gpus
def test_ddp_cuda_graph_multi_gpu():
    n = min(torch.cuda.device_count(), 4)
    assert run_multiprocess(_graph_cases, n, backend="nccl", start_method="spawn", timeout=300) == [True] * n


@pytest.mark.multigpu
@needs_2_gpus
def test_ddp_join_uneven_inputs_multi_gpu():
    n = min(torch.cuda.device_count(), 4)
    assert run_multiprocess(_join_against_torch, n, backend="nccl", start_method="spawn", timeout=300) == [True] * n
