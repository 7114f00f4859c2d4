"""The cases of the conformance test (test_conformance.py): each calls the functions under test
through `d`, which is either pynccl or torch.distributed, with the same arguments (the signatures
are the same), so one body gives pynccl's result and torch's on the same data. Data are small
integers, so every result is exact and the two must be equal, element for element.

A case returns what it saw: return values (normalised by `normalize`: a Work is "Work", a Future
"Future", a group its global ranks) and output tensors. Cases never let one rank raise while the
others go on into a collective: every raising call raises on every rank, before communicating.
`closed_form` (optional) is the expected value where torch's gloo lacks the op (all_to_all on
torch 2.11).
"""
from __future__ import annotations

import datetime
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as tdist

R = tdist.ReduceOp   # torch's ReduceOp for both: torch code calling pynccl passes torch's ops


class Case(NamedTuple):
    function: str                       # the torch.distributed function it checks
    body: Callable
    closed_form: Optional[Callable] = None


CASES: List[Case] = []


def case(function: str, closed_form: Optional[Callable] = None):
    def register(body):
        CASES.append(Case(function, body, closed_form))
        return body
    return register


def normalize(x):
    """A comparable, printable form of what a call returned."""
    import pynccl
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.tolist())
    if isinstance(x, torch._C.Future):   # torch.futures.Future and the C++ futures torch returns
        return "Future"
    if isinstance(x, pynccl.ProcessGroup):
        return ("group", x.ranks)
    if isinstance(x, tdist.ProcessGroup):
        return ("group", tdist.get_process_group_ranks(x))
    if hasattr(x, "wait") and hasattr(x, "is_completed"):
        return "Work"
    if isinstance(x, (list, tuple)):
        return [normalize(e) for e in x]
    if isinstance(x, dict):
        return {k: normalize(v) for k, v in x.items()}
    return repr(x)


def _t(rank: int, n: int = 4, dtype=torch.float32) -> torch.Tensor:
    return torch.arange(n, dtype=dtype) + 1 + rank


def _edge_group(d, ws):
    """The group of the first and last rank: at world size 3, rank 1 is outside it."""
    return d.new_group([0, ws - 1])


# ----------------------------------------------------------------------------- collectives
@case("all_reduce")
def _all_reduce(d, rank, ws):
    out = []
    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG):
        t = _t(rank)
        out.append((d.all_reduce(t, op=op), t))
    for op in (R.BAND, R.BOR, R.BXOR):
        t = torch.tensor([rank + 1, 6, 5 * rank + 3])
        out.append((d.all_reduce(t, op), t))
    t = _t(rank)
    w = d.all_reduce(t, group=tdist.GroupMember.WORLD, async_op=True)
    out.append((w, w.wait(), t))
    g, t = _edge_group(d, ws), _t(rank)
    out.append((d.all_reduce(t, R.MAX, g), t))   # skipped (None, a warning) on a rank outside g
    return out


@case("broadcast")
def _broadcast(d, rank, ws):
    t = _t(rank)
    out = [d.broadcast(t, ws - 1), t]
    t = _t(rank, dtype=torch.int64)
    w = d.broadcast(t, src=1, async_op=True)
    out += [w, w.wait(), t]
    g, t = _edge_group(d, ws), _t(rank)
    out += [d.broadcast(t, group=g, group_src=1), t]   # group rank 1 = global ws-1
    return out


@case("reduce")
def _reduce(d, rank, ws):
    t = _t(rank)
    ret = d.reduce(t, 1, R.MAX)
    out = [ret, t if rank == 1 else None]   # only dst's tensor is defined
    g, t = _edge_group(d, ws), _t(rank)
    ret = d.reduce(t, op=R.SUM, group=g, group_dst=0)
    return out + [ret, t if rank == 0 else None]


@case("all_gather")
def _all_gather(d, rank, ws):
    lst = [torch.zeros(3) for _ in range(ws)]
    ret = d.all_gather(lst, _t(rank, 3))
    lst2 = [torch.zeros(2, dtype=torch.int32) for _ in range(ws)]
    w = d.all_gather(lst2, _t(rank, 2, torch.int32), async_op=True)
    return [ret, lst, w, w.wait(), lst2]


@case("all_gather_into_tensor")
def _all_gather_into_tensor(d, rank, ws):
    out = torch.zeros(ws * 3)
    ret = d.all_gather_into_tensor(out, _t(rank, 3))
    out2 = torch.zeros(ws * 2, dtype=torch.float64)   # torch's gloo takes the flat form only
    w = d.all_gather_into_tensor(out2, _t(rank, 2, torch.float64), async_op=True)
    return [ret, out, w, w.wait(), out2]


@case("reduce_scatter")
def _reduce_scatter(d, rank, ws):
    out = torch.zeros(2)
    ret = d.reduce_scatter(out, [_t(rank + i, 2) for i in range(ws)], op=R.SUM)
    return [ret, out]


@case("reduce_scatter_tensor")
def _reduce_scatter_tensor(d, rank, ws):
    out = torch.zeros(3)
    ret = d.reduce_scatter_tensor(out, _t(rank, 3 * ws), R.MAX)
    out2 = torch.zeros(2)
    w = d.reduce_scatter_tensor(out2, _t(rank, 2 * ws), async_op=True)
    return [ret, out, w, w.wait(), out2]


def _all_to_all_expected(rank, ws):
    return [None, [normalize(torch.full((2,), float(10 * src + rank))) for src in range(ws)]]


@case("all_to_all", closed_form=_all_to_all_expected)
def _all_to_all(d, rank, ws):
    outs = [torch.zeros(2) for _ in range(ws)]
    ret = d.all_to_all(outs, [torch.full((2,), float(10 * rank + dst)) for dst in range(ws)])
    return [ret, outs]


@case("all_to_all_single")
def _all_to_all_single(d, rank, ws):
    out = torch.zeros(ws * 2)
    ret = d.all_to_all_single(out, _t(rank, ws * 2))
    # uneven: rank r sends r+1 rows to every rank, receives src+1 from each src
    inp = torch.full((ws * (rank + 1), 2), float(rank))
    out2 = torch.zeros(sum(src + 1 for src in range(ws)), 2)
    w = d.all_to_all_single(out2, inp, [src + 1 for src in range(ws)], [rank + 1] * ws, async_op=True)
    return [ret, out, w, w.wait(), out2]


@case("gather")
def _gather(d, rank, ws):
    dst = ws - 1
    lst = [torch.zeros(3) for _ in range(ws)] if rank == dst else None
    ret = d.gather(_t(rank, 3), lst, dst=dst)
    lst0 = [torch.zeros(2) for _ in range(ws)] if rank == 0 else None
    ret0 = d.gather(_t(rank, 2), lst0)                      # dst=None: global rank 0
    g = _edge_group(d, ws)
    lstg = [torch.zeros(2) for _ in range(2)] if rank == ws - 1 else None
    retg = d.gather(_t(rank, 2), lstg, group=g, group_dst=1)
    return [ret, lst, ret0, lst0, retg, lstg]


@case("scatter")
def _scatter(d, rank, ws):
    out = torch.zeros(3)
    src_list = [_t(10 * i, 3) for i in range(ws)] if rank == 1 else None
    ret = d.scatter(out, src_list, src=1)
    out0 = torch.zeros(2)
    ret0 = d.scatter(out0, [_t(i, 2) for i in range(ws)] if rank == 0 else None)   # src=None: rank 0
    return [ret, out, ret0, out0]


@case("barrier")
def _barrier(d, rank, ws):
    w = d.barrier(async_op=True)
    return [d.barrier(), w, w.wait(), d.barrier(_edge_group(d, ws))]


@case("all_reduce_coalesced")
def _all_reduce_coalesced(d, rank, ws):
    ts = [_t(rank, 3), _t(rank, 1), _t(rank, 2)]   # one dtype: torch refuses a mix (pynccl takes one)
    ret = d.all_reduce_coalesced(ts, R.MAX)
    ts2 = [_t(rank, 2), _t(rank, 3)]
    fut = d.all_reduce_coalesced(ts2, async_op=True)
    return [ret, ts, fut, fut.wait(), ts2]


@case("all_gather_coalesced")
def _all_gather_coalesced(d, rank, ws):
    ins = [_t(rank, 3), torch.full((2, 2), float(rank))]
    outs = [[torch.zeros(3), torch.zeros(2, 2)] for _ in range(ws)]
    ret = d.all_gather_coalesced(outs, ins)
    outs2 = [[torch.zeros(1)] for _ in range(ws)]
    fut = d.all_gather_coalesced(outs2, [torch.tensor([float(rank)])], async_op=True)
    return [ret, outs, fut, fut.wait(), outs2]


# ----------------------------------------------------------------------------- point-to-point
def _ring(rank, ws):
    return (rank + 1) % ws, (rank - 1) % ws


@case("send")
def _send_recv(d, rank, ws):
    nxt, prv = _ring(rank, ws)
    got = torch.zeros(3)
    # rank 0 sends first, the others receive first: a blocking ring that cannot deadlock
    if rank == 0:
        sent = d.send(_t(rank, 3), nxt)
        sender = d.recv(got, prv)
    else:
        sender = d.recv(got, src=prv)
        sent = d.send(_t(rank, 3), dst=nxt)
    return [sent, sender, got]


@case("recv")
def _recv_any_source(d, rank, ws):
    got = torch.zeros(2)
    if rank == 0:
        return [sorted(d.recv(got) for _ in range(ws - 1))]   # any source: returns the sender
    return [d.send(torch.full((2,), float(rank)), 0)]


@case("isend")
def _isend_irecv(d, rank, ws):
    nxt, prv = _ring(rank, ws)
    got = torch.zeros(4)
    ws_ = [d.isend(_t(rank), nxt), d.irecv(got, prv)]
    done = [w.wait() for w in ws_]
    got2 = torch.zeros(2, dtype=torch.int64)
    w2 = [d.isend(_t(rank, 2, torch.int64), group_dst=nxt), d.irecv(got2, group_src=prv)]
    return [ws_, done, got, [w.wait() for w in w2], got2]


@case("irecv")
def _irecv_outside_group(d, rank, ws):
    g = _edge_group(d, ws)
    if rank in (0, ws - 1):
        return ["member"]
    return [d.irecv(torch.zeros(1), src=0, group=g)]   # NON_GROUP_MEMBER: skipped, None


@case("batch_isend_irecv")
def _batch(d, rank, ws):
    nxt, prv = _ring(rank, ws)
    a, b = torch.zeros(3), torch.zeros(2, dtype=torch.int64)
    ops = [d.P2POp(d.isend, _t(rank, 3), nxt), d.P2POp(d.irecv, a, prv),
           d.P2POp(d.isend, _t(rank, 2, torch.int64), group_peer=prv), d.P2POp(d.irecv, b, group_peer=nxt)]
    works = d.batch_isend_irecv(ops)
    distinct = len({id(w) for w in works})   # gloo: one Work per op, not one Work n times
    return [works, distinct, [w.wait() for w in works], a, b]


# ----------------------------------------------------------------------------- objects
def _obj(rank):
    return {"rank": rank, "blob": list(range(rank * 3)), "name": "r" * (rank + 1)}


@case("all_gather_object")
def _all_gather_object(d, rank, ws):
    lst = [None] * ws
    ret = d.all_gather_object(lst, _obj(rank))
    return [ret, lst, d.all_gather_object([None] * 2, 1, group=_edge_group(d, ws))]


@case("broadcast_object_list")
def _broadcast_object_list(d, rank, ws):
    lst = [_obj(rank), rank] if rank == 1 else [None, None]
    mine = lst[0]
    ret = d.broadcast_object_list(lst, src=1)
    lst0 = [_obj(rank)]
    ret0 = d.broadcast_object_list(lst0, device=torch.device("cpu"))   # src=None: rank 0
    return [ret, lst, rank != 1 or lst[0] is mine, ret0, lst0]          # the source's list is left as it is


@case("gather_object")
def _gather_object(d, rank, ws):
    lst = [None] * ws if rank == ws - 1 else None
    ret = d.gather_object(_obj(rank), lst, dst=ws - 1)
    g = _edge_group(d, ws)
    lstg = [None] * 2 if rank == 0 else None
    retg = d.gather_object(_obj(rank), lstg, group=g, group_dst=0)
    return [ret, lst, retg, lstg]


@case("scatter_object_list")
def _scatter_object_list(d, rank, ws):
    out = [None]
    ret = d.scatter_object_list(out, [_obj(10 + r) for r in range(ws)] if rank == 1 else None, src=1)
    out0 = [None]
    ret0 = d.scatter_object_list(out0, [r * r for r in range(ws)] if rank == 0 else None)
    return [ret, out, ret0, out0]


@case("send_object_list")
def _send_recv_object_list(d, rank, ws):
    out = []
    for use_batch in (False, True):
        if rank == 0:
            out.append(d.send_object_list([_obj(0), "x", None], dst=ws - 1, use_batch=use_batch))
        elif rank == ws - 1:
            lst = [None] * 3
            out += [d.recv_object_list(lst, src=0, device=torch.device("cpu"), use_batch=use_batch), lst]
    return out


@case("recv_object_list")
def _recv_object_list(d, rank, ws):
    if rank == 0:
        lst = [None] * 2
        return [d.recv_object_list(lst, group_src=ws - 1), lst]   # returns the sender's global rank
    if rank == ws - 1:
        return [d.send_object_list([1.5, {"k": (1, 2)}], group_dst=0)]
    return []


# ----------------------------------------------------------------------------- groups
@case("new_group")
def _new_group(d, rank, ws):
    g = _edge_group(d, ws)
    sub = d.new_group(list(range(ws)), timeout=datetime.timedelta(seconds=60), backend="gloo")
    return [g, sub, d.get_rank(g), d.get_world_size(g), d.get_rank(sub), d.get_world_size(sub)]


@case("get_rank")
def _ranks(d, rank, ws):
    g = _edge_group(d, ws)
    return [d.get_rank(), d.get_world_size(), d.get_rank(g), d.get_world_size(g),
            d.get_rank(tdist.GroupMember.WORLD), d.get_world_size(group=None)]


@case("get_world_size")
def _world_size(d, rank, ws):
    return [d.get_world_size(), d.get_world_size(_edge_group(d, ws))]


@case("get_process_group_ranks")
def _process_group_ranks(d, rank, ws):
    g = d.new_group([ws - 1, 0])
    return [d.get_process_group_ranks(g) if rank in (0, ws - 1) else None, d.get_process_group_ranks(None)]


@case("get_global_rank")
def _global_group_rank(d, rank, ws):
    g = _edge_group(d, ws)
    if rank not in (0, ws - 1):
        return []
    return [d.get_global_rank(g, 1), d.get_global_rank(g, 0), d.get_group_rank(g, ws - 1)]


@case("get_group_rank")
def _group_rank(d, rank, ws):
    g = _edge_group(d, ws)
    world = tdist.GroupMember.WORLD if d is tdist else d.get_default_group()
    return [d.get_group_rank(g, ws - 1) if rank in (0, ws - 1) else None, d.get_group_rank(world, rank)]


@case("new_subgroups")
def _new_subgroups(d, rank, ws):
    mine, subs = d.new_subgroups(group_size=1)
    t = torch.tensor([rank + 1.0])
    d.all_reduce(t, group=mine)
    return [mine, subs, t]


@case("new_subgroups_by_enumeration")
def _new_subgroups_by_enumeration(d, rank, ws):
    lists = [[0, ws - 1]] + [[r] for r in range(1, ws - 1)]
    mine, subs = d.new_subgroups_by_enumeration(lists)
    t = torch.tensor([rank + 1.0])
    d.all_reduce(t, group=mine)
    return [mine, subs, t]


@case("get_backend")
def _get_backend(d, rank, ws):
    return [d.get_backend(), d.get_backend(tdist.GroupMember.WORLD)]


@case("monitored_barrier")
def _monitored_barrier(d, rank, ws):
    return [d.monitored_barrier(timeout=datetime.timedelta(seconds=30)),
            d.monitored_barrier(wait_all_ranks=True)]


@case("is_initialized")
def _availability(d, rank, ws):
    return [d.is_initialized(), d.is_available(), d.is_gloo_available()]


@case("ProcessGroup")
def _process_group_methods(d, rank, ws):
    g = _edge_group(d, ws)
    if rank not in (0, ws - 1):
        return [g]
    return [g.rank(), g.size(), d.get_rank(g)]


# ----------------------------------------------------------------------------- NON_GROUP_MEMBER
def _non_member_calls(d, rank, ws) -> Dict[str, Callable]:
    """Every function of the API on GroupMember.NON_GROUP_MEMBER (what a rank outside a group
    holds), as a call to make on such a rank: the group is new_group([0]), made just before, and
    roots are its rank, global 0 (test_conformance.conformance_run)."""
    ngm = tdist.GroupMember.NON_GROUP_MEMBER
    t = torch.zeros(2)
    return {
        "all_reduce": lambda: d.all_reduce(t, group=ngm),
        "all_gather": lambda: d.all_gather([t, t], t, group=ngm),
        "all_gather_into_tensor": lambda: d.all_gather_into_tensor(torch.zeros(4), t, group=ngm),
        "reduce_scatter": lambda: d.reduce_scatter(t, [t, t], group=ngm),
        "reduce_scatter_tensor": lambda: d.reduce_scatter_tensor(t, torch.zeros(4), group=ngm),
        "all_to_all_single": lambda: d.all_to_all_single(t, t, group=ngm),
        "all_to_all": lambda: d.all_to_all([t, t], [t, t], group=ngm),
        "barrier": lambda: d.barrier(ngm),
        "broadcast": lambda: d.broadcast(t, 0, group=ngm),
        "broadcast(group_src)": lambda: d.broadcast(t, group=ngm, group_src=0),
        "reduce": lambda: d.reduce(t, 0, group=ngm),
        "reduce(group_dst)": lambda: d.reduce(t, group=ngm, group_dst=0),
        "gather": lambda: d.gather(t, None, 0, group=ngm),
        "scatter": lambda: d.scatter(t, None, 0, group=ngm),
        "scatter(group_src)": lambda: d.scatter(t, None, group=ngm, group_src=0),
        "isend": lambda: d.isend(t, 0, group=ngm),
        "isend(group_dst)": lambda: d.isend(t, group=ngm, group_dst=0),
        "irecv": lambda: d.irecv(t, 0, group=ngm),
        "send": lambda: d.send(t, 0, group=ngm),
        "recv": lambda: d.recv(t, 0, group=ngm),
        "all_reduce_coalesced": lambda: d.all_reduce_coalesced([t], group=ngm),
        "all_gather_coalesced": lambda: d.all_gather_coalesced([[t]], [t], group=ngm),
        "all_gather_object": lambda: d.all_gather_object([None], 1, group=ngm),
        "broadcast_object_list": lambda: d.broadcast_object_list([None], 0, group=ngm),
        "broadcast_object_list(group_src)": lambda: d.broadcast_object_list([None], group=ngm, group_src=0),
        "gather_object": lambda: d.gather_object(1, None, 0, group=ngm),
        "gather_object(group_dst)": lambda: d.gather_object(1, None, group=ngm, group_dst=0),
        "scatter_object_list": lambda: d.scatter_object_list([None], None, 0, group=ngm),
        "send_object_list": lambda: d.send_object_list([1], 0, group=ngm),
        "recv_object_list": lambda: d.recv_object_list([None], 0, group=ngm),
        "monitored_barrier": lambda: d.monitored_barrier(ngm),
        "get_rank": lambda: d.get_rank(ngm),
        "get_world_size": lambda: d.get_world_size(ngm),
        "get_backend": lambda: d.get_backend(ngm),
        "destroy_process_group": lambda: d.destroy_process_group(ngm),
    }


NON_MEMBER_CALLS = sorted(_non_member_calls(None, 0, 0))
