"""pynccl DDP on NCCL: equal to torch DDP (on torch's own NCCL group) at world size 1 on one GPU
and at world size 2+ where there are several GPUs, on every path (one fused C++ call per bucket,
gradients as bucket views, find_unused_parameters, static_graph, Python hooks, torch's hook,
registered buffers, CTA policy, join), each with SGD without and with momentum (linear in the
gradient: a wrong 1/N moves every parameter by a step's worth) and AdamW (scale-invariant), within
the bounds tests/numerics.py derives; a whole training step (forward, backward, bucketed
all-reduce, optimizer) captured in a CUDA graph and replayed equals eager and torch DDP."""
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
from numerics import assert_within, chain_rtol, record_grad_scale, trained_atol

STEPS = 6
OPTIMIZERS = ("plain-sgd", "sgd", "adamw")
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


def _build(device, wrap, slow=False, sgd=False, opt="adamw", **opt_kw):
    """The model wrapped, and its optimizer: "plain-sgd" (no momentum), "sgd" (momentum 0.9) or
    "adamw"; sgd=True is "plain-sgd"."""
    torch.manual_seed(0)
    model = wrap(Net(slow).to(device))
    opt = "plain-sgd" if sgd else opt
    if opt != "adamw":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if opt == "sgd" else 0.0, **opt_kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **opt_kw)


def _data(rank, ws, device, steps=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = torch.randn(8 * ws, 32, generator=g), torch.randn(8 * ws, 16, generator=g)
        out.append((x.chunk(ws)[rank].to(device), y.chunk(ws)[rank].to(device)))
    return out


def _step(model, opt, x, y, set_to_none=True, grad_scale=None):
    opt.zero_grad(set_to_none=set_to_none)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    if grad_scale is not None:
        record_grad_scale(model.parameters(), grad_scale)
    opt.step()
    return loss


def _record_local_grad_scale(model, grad_scale: dict) -> None:
    """grad_scale[p] >= the largest |local gradient| p gets, from now on: a tensor hook sees this
    rank's own term before DDP reduces it. Above 2 ranks the terms partly cancel, so the reduced
    gradient can be smaller than they are, while two orders of the sum differ by a multiple of the
    terms' rounding (numerics.adam_state_atol's grad_scale). Eager models only (a host sync)."""
    for p in getattr(model, "module", model).parameters():
        p.register_hook(lambda g, p=p: grad_scale.__setitem__(p, max(grad_scale.get(p, 0.0), g.abs().max().item())))


def _max_over_ranks(grad_scale: dict, model, group) -> None:
    """grad_scale's entries become their largest over the ranks (a term of the sum is any rank's)."""
    params = [p for p in getattr(model, "module", model).parameters() if p in grad_scale]
    if not params:
        return
    values = torch.tensor([grad_scale[p] for p in params], dtype=torch.float64, device=params[0].device)
    tdist.all_reduce(values, tdist.ReduceOp.MAX, group=group)
    grad_scale.update(zip(params, values.tolist()))


def _compares_trajectory(opt_name, ws) -> bool:
    """Whether a run of several steps is held to numerics.trained_atol against torch DDP's run.
    Not AdamW above 2 ranks: there the two communicators' sums reassociate from the first step, the
    parameters' differences feed back into later gradients, and AdamW divides each element's update
    by its own gradient history, which first-order bounds do not cover (session 17, 4xH100: 1-4x
    the bound after 4-8 steps; session 12 saw the same over 6 steps). At 2 ranks an fp32 sum of two
    terms rounds the same in either order (and the 1/2 is exact), so the runs agree; above, AdamW is
    compared step by step from equal states (_against_torch_ddp), join's divisors against torch by
    the SGD runs, and the runs here are still held to each other (graphed against eager, every rank
    against the last joiner)."""
    return ws <= 2 or opt_name != "adamw"


def vs_torch_rtol(ws):
    """Relative gradient difference against torch DDP (tests/numerics.py): the same local forward
    and backward (the same kernels on the same shapes); NCCL sums ws terms in an order the two
    communicators may choose differently, and 1/ws is applied before or after: (ws + 1)·eps."""
    return chain_rtol(ws + 1)


def _assert_trained_close(ours, theirs, their_opt, grad_scale, rtol, what, steps=STEPS):
    """ours' parameters against theirs', trained by their_opt: numerics.trained_atol element-wise."""
    for i, (p, q) in enumerate(zip(_params(ours), getattr(theirs, "module", theirs).parameters())):
        assert_within(p, q, trained_atol(their_opt, q, rtol, grad_scale.get(q), steps), f"{what}: parameter {i}")


@torch.no_grad()
def _take_state(ours, opt_ours, theirs, opt_theirs):
    """ours' parameters and optimizer state become copies of theirs' (equal starting points)."""
    for p, q in zip(ours.module.parameters(), theirs.module.parameters()):
        p.copy_(q)
        for key, value in opt_theirs.state.get(q, {}).items():
            mine = opt_ours.state[p][key]
            if isinstance(value, torch.Tensor):
                mine.copy_(value)
            else:
                opt_ours.state[p][key] = value


def _params(model):
    return [p.detach().clone() for p in getattr(model, "module", model).parameters()]


def _against_torch_ddp(rank, ws):
    """Every case runs with every optimizer, then one assertion lists each failure. Above world
    size 1, torch's communicator and ours may sum a bucket's elements in different orders (NCCL
    picks the algorithm and chunking per call size, and the two DDPs' first buckets differ):
    vs_torch_rtol on each step's gradients, carried through one optimizer step by
    numerics.trained_atol (compare() restarts both from equal states every step)."""
    device = pynccl.get_device()
    # pynccl's torch.distributed default group is gloo; torch DDP gets its own NCCL group.
    torch_pg = tdist.new_group(backend="nccl")
    data = _data(rank, ws, device)
    rtol = vs_torch_rtol(ws)
    failures, compared = [], []

    def compare(name, make_ours, make_theirs, opt_name, slow, set_to_none=True, setup=None, rtol=rtol):
        """Step by step from equal starting points: the gradients (DDP's whole job) within rtol of
        each tensor's largest, then one optimizer step within numerics.trained_atol(steps=1); then
        ours takes torch's parameters and optimizer state, so a rounding difference never feeds
        back into later gradients (first-order bounds hold per step; at 4 ranks the bound over 6
        AdamW steps did not, session 12)."""
        ours, opt_ours = _build(device, make_ours, slow, opt=opt_name)
        theirs, opt_theirs = _build(device, make_theirs, slow, opt=opt_name)
        if setup is not None:
            setup(ours)
        what = f"{name} {opt_name}"
        try:
            for i, (x, y) in enumerate(data):
                scale = {}
                for m, o in ((ours, opt_ours), (theirs, opt_theirs)):
                    o.zero_grad(set_to_none=set_to_none)
                    ((m(x) - y) ** 2).mean().backward()
                record_grad_scale(theirs.module.parameters(), scale)
                for j, (p, q) in enumerate(zip(ours.module.parameters(), theirs.module.parameters())):
                    assert (p.grad is None) == (q.grad is None), f"{what}: step {i} parameter {j} has a grad on one side"
                    if q.grad is not None:
                        assert_within(p.grad, q.grad, rtol * scale[q], f"{what}: step {i} gradient of parameter {j}")
                opt_ours.step()
                opt_theirs.step()
                _assert_trained_close(ours, theirs, opt_theirs, scale, rtol, f"{what}: step {i}", steps=1)
                _take_state(ours, opt_ours, theirs, opt_theirs)
        except AssertionError as e:
            failures.append(str(e))
        compared.append(what)
        return ours

    # (DDP kwargs, slow backward, delayed Python hook). Without a hook of its own a bucket runs
    # as one C++ reduce_bucket call; the delayed hook takes the Python path with the same streams.
    # NOTE: copies named (pynccl's default is views); the unnamed find_unused / static_graph cases run views.
    view, copies = dict(gradient_as_bucket_view=True), dict(gradient_as_bucket_view=False)
    cases = ((copies, False, False), (view, False, False), (copies, True, False), (view, True, False),
             (dict(find_unused_parameters=True), True, False), (dict(static_graph=True), True, False),
             (copies, True, True), (view, True, True))
    for kw, slow, delayed_hook in cases:
        set_to_none = kw.get("gradient_as_bucket_view") is not True    # explicit views: zeroed in place
        name = f"{kw}{' slow backward' if slow else ''}{' delayed Python hook' if delayed_hook else ' one C++ call'}"

        def setup(d, delayed_hook=delayed_hook):
            assert len(d.reducer.bucketer.buckets) > 2
            if delayed_hook:
                d.register_comm_hook(None, _delayed_allreduce_hook)
            assert (d.reducer.fused_comm is None) == delayed_hook
        for opt_name in OPTIMIZERS:
            ours = compare(name, lambda m, kw=kw: pynccl.DistributedDataParallel(
                               m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB, **kw),
                           lambda m, kw=kw: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                     bucket_cap_mb=BUCKET_MB, **kw),
                           opt_name, slow, set_to_none, setup)
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
        for opt_name in OPTIMIZERS:
            ours = compare(name, lambda m, group=group: pynccl.DistributedDataParallel(
                               m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB, process_group=group),
                           lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                              bucket_cap_mb=BUCKET_MB),
                           opt_name, True, setup=setup)
            if name == "register_buffers":
                assert len(ours.reducer._registrations) == len(ours.reducer.bucketer.buckets) > 2

    # bf16 compression: against torch DDP with torch's own bf16 hook, and against fp32 torch DDP.
    # Gradients, relative: both sum ws bf16 values in orders that may differ, pynccl's fused hook
    # scales before the cast, torch's after it: (ws + 2) bf16 roundings; against fp32, the cast
    # and the bf16 sum: (ws + 2) roundings too, on top of fp32's reduction order. SGD only, whose
    # update is linear in the gradient: under AdamW, gradients a few per cent apart move the
    # parameters apart enough to change later gradients by as much again (a dry run on gloo went
    # 15 % over the first-order bound), so no bound derived from the gradients holds.
    bf16_rtol = (ws + 2) * 2.0 ** -7

    def bf16_ours(m):
        d = pynccl.DistributedDataParallel(m, bucket_cap_mb=BUCKET_MB)
        d.register_comm_hook(None, comm_hooks.bf16_compress_hook)
        assert d.reducer.fused_comm is not None             # a built-in hook: pack casts, unpack casts back
        return d

    def bf16_theirs(m):
        d = TorchDDP(m, process_group=torch_pg, bucket_cap_mb=BUCKET_MB)
        d.register_comm_hook(torch_pg, default_hooks.bf16_compress_hook)
        return d
    for opt_name in ("plain-sgd", "sgd"):
        compare("bf16 hook vs torch DDP's bf16 hook", bf16_ours, bf16_theirs, opt_name, False, rtol=bf16_rtol)
        compare("bf16 hook vs fp32 torch DDP", bf16_ours,
                lambda m: TorchDDP(m, process_group=torch_pg, bucket_cap_mb=BUCKET_MB), opt_name, False,
                rtol=bf16_rtol + rtol)
    assert not failures, f"rank {rank}/{ws}: {len(failures)} of {len(compared)} comparisons with torch DDP " \
        f"over their bound:\n" + "\n".join(failures)

    with pytest.raises(ValueError, match="communicates on cuda"):
        pynccl.DistributedDataParallel(Net())                  # a CPU module on an NCCL group
    return compared


def _join_against_torch(rank, ws):
    """Uneven inputs on NCCL (rank r has r + 1 batches): `with ddp.join():` ends where torch DDP's
    join ends on the same data, with the default divisor and with divide_by_initial_world_size=False."""
    device = pynccl.get_device()
    torch_pg = tdist.new_group(backend="nccl")
    data = _data(rank, ws, device, steps=ws + 1, seed=3)[:rank + 1]
    for join_kw in (dict(), dict(divide_by_initial_world_size=False)):
        for opt_name in OPTIMIZERS:
            ours, opt_ours = _build(device, lambda m: pynccl.DistributedDataParallel(
                m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB), True, opt=opt_name)
            theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                                   bucket_cap_mb=BUCKET_MB), True, opt=opt_name)
            scale = {}
            _record_local_grad_scale(theirs, scale)
            for model, opt, record in ((ours, opt_ours, None), (theirs, opt_theirs, scale)):
                with model.join(**join_kw):
                    for x, y in data:
                        _step(model, opt, x, y, grad_scale=record)
            torch.cuda.synchronize()
            _max_over_ranks(scale, theirs, torch_pg)
            what = f"join {join_kw} {opt_name}"
            # Every rank ends with the last joiner's model (rank ws - 1, with ws batches), trained by
            # that rank's optimizer: compared there, with its optimizer state and gradient scale. (An
            # earlier joiner's optimizer stepped fewer times: its state bounds fewer steps than the
            # model it holds took, and at 4 ranks, where the sums reassociate, that bound failed.)
            # Every rank holds it, bit for bit, on both sides (checked first: a collective, which a
            # rank that failed the comparison below would leave its peers waiting in).
            same = []
            for model in (ours, theirs):
                mine = torch.cat([p.reshape(-1) for p in _params(model)])
                last = mine.clone()
                tdist.broadcast(last, ws - 1, group=torch_pg)
                same.append(torch.equal(mine, last))
            assert same == [True, True], f"{what}: rank {rank}'s models (pynccl, torch) equal to the last " \
                f"joiner's: {same}"
            if rank == ws - 1 and _compares_trajectory(opt_name, ws):
                _assert_trained_close(ours, theirs, opt_theirs, scale, vs_torch_rtol(ws),
                                      f"{what} vs torch DDP's join", steps=len(data))
    return True


def _torch_nccl_first(rank, ws):
    """The script initialised torch.distributed (nccl) only: DDP bootstraps pynccl's NCCL
    communicator from it; equal to torch DDP on that default group."""
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", rank=rank, world_size=ws, device_id=torch.device("cuda", rank))
    try:
        device = torch.device("cuda", rank)
        for opt_name in OPTIMIZERS:
            ours, opt_ours = _build(device, lambda m: pynccl.DistributedDataParallel(m, device_ids=[rank]), opt=opt_name)
            assert pynccl.is_initialized() and pynccl.get_backend() == "nccl"
            theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[rank]), opt=opt_name)
            scale = {}
            for x, y in _data(rank, ws, device, steps=3):
                _step(ours, opt_ours, x, y)
                _step(theirs, opt_theirs, x, y, grad_scale=scale)
            torch.cuda.synchronize()
            _assert_trained_close(ours, theirs, opt_theirs, scale, vs_torch_rtol(ws),
                                  f"bootstrapped from torch nccl, {opt_name}, vs torch DDP", steps=3)
    finally:
        pynccl.destroy_process_group()
        tdist.destroy_process_group()
    return True


def _graph_vs_eager(rank, ws, static_graph, opt_name, torch_pg):
    """8 steps: eager pynccl DDP; the same with steps 4-8 captured once and replayed; torch DDP
    eager. Graphed against eager and against torch DDP, within numerics.trained_atol."""
    device = pynccl.get_device()
    data = _data(rank, ws, device, steps=8, seed=1)
    opt_kw = dict(capturable=True) if opt_name == "adamw" else {}   # SGD keeps no step count on the host

    def wrap(m):
        return pynccl.DistributedDataParallel(m, device_ids=[device.index], bucket_cap_mb=BUCKET_MB,
                                              static_graph=static_graph)

    eager, opt_eager = _build(device, wrap, opt=opt_name, **opt_kw)
    theirs, opt_theirs = _build(device, lambda m: TorchDDP(m, device_ids=[device.index], process_group=torch_pg,
                                                           bucket_cap_mb=BUCKET_MB, static_graph=static_graph),
                                opt=opt_name, **opt_kw)
    eager_scale, their_scale = {}, {}
    _record_local_grad_scale(eager, eager_scale)
    _record_local_grad_scale(theirs, their_scale)
    for x, y in data:
        _step(eager, opt_eager, x, y, grad_scale=eager_scale)
        _step(theirs, opt_theirs, x, y, grad_scale=their_scale)

    graphed, opt_graphed = _build(device, wrap, opt=opt_name, **opt_kw)
    # Eager warm-up on a side stream (as torch's docs do): builds, then rebuilds the buckets, and
    # creates the optimizer's state (SGD's momentum buffers) before capture.
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
    _max_over_ranks(eager_scale, eager, torch_pg)
    _max_over_ranks(their_scale, theirs, torch_pg)
    what = f"CUDA graph (static_graph={static_graph}) {opt_name}"
    # The same kernels, communicator and sizes as eager. NOTE: held to the first-order bound over 8
    # steps, AdamW too, at 4 ranks: it passed there (4xH100, s17) because NCCL picks the same
    # algorithm in the capture as in eager; were the order to differ, that bound would not cover
    # AdamW's trajectory (_compares_trajectory).
    _assert_trained_close(graphed, eager, opt_eager, eager_scale, vs_torch_rtol(ws), f"{what} vs eager", steps=8)
    if _compares_trajectory(opt_name, ws):
        _assert_trained_close(graphed, theirs, opt_theirs, their_scale, vs_torch_rtol(ws), f"{what} vs torch DDP",
                              steps=8)
    return True


def _graph_cases(rank, ws):
    torch_pg = tdist.new_group(backend="nccl")
    return all(_graph_vs_eager(rank, ws, static_graph, opt_name, torch_pg)
               for static_graph in (False, True) for opt_name in OPTIMIZERS)


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
