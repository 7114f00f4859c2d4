"""pynccl against torch.distributed and torch DDP in the same ranks, on gloo, argument by argument,
where a swap of one for the other could silently change results: every body runs once through
torch and once through pynccl on the same data, and the two must agree (or pynccl must refuse,
naming what it expected, where torch computes something pynccl cannot).

Divergences this file found (each test below failed on the code before its fix):
* all_to_all / all_to_all_single with async_op=True on gloo were point-to-point sends: the Work had
  no get_future() (torch's RuntimeError "Work::getFuture not implemented"), and a Work let go
  unwaited cancelled its sends, so the next collective hung (torch's op completes regardless).
* DistributedDataParallel(broadcast_buffers=False) still overwrote every rank's buffers with rank
  0's at construction; torch leaves them rank-local from the start (e.g. BatchNorm statistics).
* an async all_gather's / gather's get_future() value (and result()) was [output_list], where torch's
  is the output list itself.
* DistributedDataParallel took process_group as its 6th positional argument, where torch has init_sync
  (and bucket_cap_mb 7th, find_unused_parameters 8th ...); init_sync, device_mesh, check_reduction and
  torch 2.14's forward_sync_buffers and batched_grad_copy were TypeErrors.
"""
import gc
import inspect
import sys
import warnings

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import pynccl
from pynccl.testing import run_multiprocess

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from numerics import chain_rtol, max_rel_diff  # noqa: E402

SIDES = (("torch", tdist), ("pynccl", pynccl))


def _both(body, rank, ws):
    """{side: body(d, rank, ws)} for torch.distributed then pynccl, a barrier after each side."""
    seen = {}
    for name, d in SIDES:
        seen[name] = body(d, rank, ws)
        tdist.barrier()
    return seen


# ----------------------------------------------------------------------------- all_to_all's Work
def _all_to_all_async(d, rank, ws):
    inp = torch.arange(ws * 2.0) + 10 * rank
    out = torch.zeros(ws * 2)
    work = d.all_to_all_single(out, inp, async_op=True)
    value = work.get_future().wait()              # old pynccl: RuntimeError "Work::getFuture not implemented"
    got = [len(value), value[0] is out, out.tolist()]
    # a Work let go unwaited: torch's op completes all the same and the next collective pairs as usual
    # (old pynccl: the dropped sends were cancelled and the next all_to_all_single hung)
    dropped = torch.zeros(ws * 2)
    d.all_to_all_single(dropped, inp + 100, async_op=True)
    after = torch.zeros(ws * 2)
    d.all_to_all_single(after, inp + 1000, [2] * ws, [2] * ws)
    d.barrier()                                   # gloo's barrier waits for the ops before it
    return got + [dropped.tolist(), after.tolist()]


def _uneven_all_to_all(rank, ws):
    """pynccl's list all_to_all with uneven sizes (torch's gloo refuses those): rank r sends r + 1
    values to every rank, so rank r gets src + 1 values from each src; async, read through the future."""
    outs = [torch.zeros(src + 1, dtype=torch.int64) for src in range(ws)]
    work = pynccl.all_to_all(outs, [torch.full((rank + 1,), 10 * rank + dst) for dst in range(ws)], async_op=True)
    work.get_future().wait()
    assert work.is_completed()
    assert [o.tolist() for o in outs] == [[10 * src + rank] * (src + 1) for src in range(ws)]


def _all_to_all_run(rank, ws):
    seen = _both(_all_to_all_async, rank, ws)
    assert seen["pynccl"] == seen["torch"], seen
    _uneven_all_to_all(rank, ws)
    return True


@pytest.mark.parametrize("ws", [2, 3])
def test_async_all_to_all_work_as_torchs(ws):
    assert run_multiprocess(_all_to_all_run, ws, timeout=60) == [True] * ws


# ----------------------------------------------------------------------------- refusals and groups
def _refusals(rank, ws):
    """Where torch's gloo computes what pynccl cannot, pynccl refuses, naming what it expected; it
    never computes something else."""
    for dtype, value in ((torch.bool, [True, False]), (torch.complex64, [1 + 1j, 2])):
        with pytest.raises(TypeError, match=f"dtype {dtype} is not supported by the gloo backend"):
            pynccl.all_reduce(torch.tensor(value, dtype=dtype))
    with pytest.raises(ValueError, match="expected a contiguous tensor"):
        pynccl.all_gather_into_tensor(torch.zeros(ws * 4, 2)[:, 0], torch.ones(4))
    with pytest.raises(ValueError, match=rf"object_list has {ws + 1} entries, expected world_size\({ws}\)"):
        pynccl.all_gather_object([None] * (ws + 1), rank)     # torch fills the first ws, leaves the rest
    with pytest.raises(TypeError, match="op must be a pynccl.ReduceOp, a torch.distributed.ReduceOp"):
        pynccl.all_reduce(torch.ones(2), "max")


def _groups_and_works(d, rank, ws, tg, mesh):
    """torch's group spellings, rank queries on a torch group, and async Works' futures."""
    out = []
    for group in (None, tdist.GroupMember.WORLD, tdist.group.WORLD, mesh.get_group(), tg):
        t = torch.arange(3, dtype=torch.int64) * (rank + 1)
        out.append([d.all_reduce(t, tdist.ReduceOp.MAX, group=group), t.tolist()])
    if tg is not tdist.GroupMember.NON_GROUP_MEMBER:
        out.append([d.get_rank(tg), d.get_world_size(tg), d.get_process_group_ranks(tg),
                    [d.get_group_rank(tg, r) for r in (0, ws - 1)], [d.get_global_rank(tg, r) for r in (0, 1)]])
    t = torch.arange(4, dtype=torch.int64) + rank
    work = d.broadcast(t, src=ws - 1, async_op=True)
    value = work.get_future().wait()              # NOTE: torch's gloo completes the future before its Work
    out.append([len(value), value[0] is t, t.tolist(), work.wait(), work.is_completed()])
    t = torch.zeros(2, dtype=torch.int64)
    work = d.scatter(t, [torch.full((2,), i) for i in range(ws)] if rank == 1 else None, src=1, async_op=True)
    work.wait()
    out.append([work.is_completed(), t.tolist(), [x.tolist() for x in work.result()]])
    # the gathers' futures hold the output list itself (pynccl's held [list]); gather's only on its dst
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(ws)]
    work = d.all_gather(outs, torch.full((2,), rank), async_op=True)
    value = work.get_future().wait()
    work.wait()                                   # torch's gloo completes the future before its Work
    out.append([[x is o for x, o in zip(value, outs)], [x.tolist() for x in value], len(work.result())])
    outs = [torch.zeros(2, dtype=torch.int64) for _ in range(ws)] if rank == 0 else None
    value = d.gather(torch.full((2,), rank), outs, dst=0, async_op=True).get_future().wait()
    out.append([x.tolist() for x in value])
    objs = [{"from": 1}, [1, 2]] if rank == 1 else [None, None]
    d.broadcast_object_list(objs, group_src=1, device=torch.device("cpu"))
    got = [None]
    d.scatter_object_list(got, [f"to {i}" for i in range(ws)] if rank == ws - 1 else None, group_src=ws - 1)
    out.append([objs, got])
    return out


def _groups_run(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    tg = tdist.new_group([0, ws - 1])
    mesh = init_device_mesh("cpu", (ws,))
    seen = _both(lambda d, r, n: _groups_and_works(d, r, n, tg, mesh), rank, ws)
    assert seen["pynccl"] == seen["torch"], seen
    _refusals(rank, ws)
    return True


def test_groups_works_and_refusals_as_torch():
    assert run_multiprocess(_groups_run, 3, timeout=60) == [True] * 3


# ----------------------------------------------------------------------------- DDP
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b, self.c = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.Linear(2, 2)

    def forward(self, x, use_c=True):
        h = self.b(self.bn(self.a(x)))
        return h + self.c(h) if use_c else h


def _ddp_run(ddp_cls, rank, kw, hook, steps, use_c=True):
    """(grads, state_dict) after `steps` steps of rank-local data, the model's running mean made
    rank-dependent before wrapping (so whether construction broadcast the buffers shows)."""
    torch.manual_seed(0)
    net = _Net()
    with torch.no_grad():
        net.bn.running_mean.fill_(float(rank))
        net.a.bias.add_(rank)                     # rank-local parameters too: what init_sync decides
    args, kw = kw.pop("*args", ()), {k: v(rank) if callable(v) else v for k, v in kw.items()}
    model = ddp_cls(net, *args, **kw)
    if hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook is not None:
        model.register_comm_hook(None, hook)
    built = {k: v.clone() for k, v in model.state_dict().items()}
    for step in range(steps):
        torch.manual_seed(100 * rank + step)
        if step == 1:
            with model.no_sync():                 # accumulated locally, reduced with the next step's
                model(torch.randn(8, 4), use_c=use_c).pow(2).sum().backward()
        model(torch.randn(8, 4), use_c=use_c).pow(2).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return built, grads, model.state_dict()


def _mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (tdist.get_world_size(),))


_DDP_CONFIGS = {
    "broadcast_buffers=False": (dict(broadcast_buffers=False), None, True),
    "init_sync=False": (dict(init_sync=False), None, True),
    # torch's positional order: module, device_ids, output_device, dim, broadcast_buffers, init_sync,
    # process_group, bucket_cap_mb, find_unused_parameters (pynccl's took process_group 6th until session 31)
    "positional": ({"*args": (None, None, 0, False, True, None, 25, True)}, None, False),
    "device_mesh": (dict(device_mesh=_mesh), None, True),
    "check_reduction": (dict(check_reduction=True), None, True),
    "default": ({}, None, True),
    "find_unused_parameters": (dict(find_unused_parameters=True), None, False),
    "gradient_as_bucket_view": (dict(gradient_as_bucket_view=True), None, True),
    "static_graph": (dict(static_graph=True), None, True),
    "allreduce_hook": ({}, default_hooks.allreduce_hook, True),
    "powerSGD": ({}, "powersgd", True),
}


def _assert_same(ours: dict, theirs: dict, what: str):
    assert list(ours) == list(theirs), f"{what}: keys {list(ours)} != torch's {list(theirs)}"
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, (what, k)
        # NOTE: the same module code on the same data; the reduction differs only in order (tiny models)
        assert max_rel_diff(ours[k].double(), theirs[k].double()) <= chain_rtol(64), \
            f"{what}: {k} {ours[k].tolist()} != torch's {theirs[k].tolist()}"


if "forward_sync_buffers" in inspect.signature(TorchDDP.__init__).parameters:     # torch >= 2.13
    _DDP_CONFIGS["forward_sync_buffers=False"] = (dict(forward_sync_buffers=False), None, True)
    _DDP_CONFIGS["batched_grad_copy"] = (dict(batched_grad_copy=True), None, True)


def _ddp_as_torch(rank, ws):
    for name, (kw, hook, use_c) in _DDP_CONFIGS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)      # torch 2.14: broadcast_buffers is deprecated
            ours = _ddp_run(pynccl.DistributedDataParallel, rank, dict(kw), hook, 3, use_c)
            theirs = _ddp_run(TorchDDP, rank, dict(kw), hook, 3, use_c)
        # old pynccl, broadcast_buffers=False: "module.bn.running_mean [0.0, ...] != torch's [1.0, ...]" on rank 1
        for what, a, b in zip(("after construction", "gradients", "state_dict"), ours, theirs):
            _assert_same(a, b, f"{name}, {what}")
    # torch's arguments pynccl does not implement: refused by name, never ignored
    for bad in (dict(mixed_precision=object()), dict(skip_all_reduce_unused_params=True),
                dict(bucket_cap_mb_list=[1, 25]), dict(delay_all_reduce_named_params=[("a.weight", None)])):
        with pytest.raises(NotImplementedError, match=f"{next(iter(bad))}=.*does not implement"):
            pynccl.DistributedDataParallel(_Net(), **bad)
    with pytest.raises(RuntimeError, match="both process_group and device_mesh"):
        pynccl.DistributedDataParallel(_Net(), process_group=pynccl.get_default_group(), device_mesh=_mesh(rank))
    with pytest.raises(TypeError, match="init_sync must be a bool"):
        pynccl.DistributedDataParallel(_Net(), init_sync=None)
    # NOTE: the DDP objects (torch's reducers, their hooks' futures) dropped here, on this thread, with every
    # rank's ops done: a torch group whose last holder went away on a gloo worker thread would be destroyed
    # there, joining that thread (std::terminate "Resource deadlock avoided", seen once in ~110 runs)
    gc.collect()
    tdist.barrier()
    return True


@pytest.mark.numerics
def test_ddp_options_and_hooks_as_torch():
    assert run_multiprocess(_ddp_as_torch, 2, timeout=120) == [True, True]
