"""Every collective on the gloo backend, every dtype, world sizes 1-4, against closed-form
values (rank r contributes arange(n) + r, as nccl-tests does). One process launch per world
size runs all checks, so the suite stays fast on two cores."""
import pytest
import torch

import pynccl
from pynccl.testing import run_multiprocess

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64,
          torch.int8, torch.uint8, torch.int32, torch.int64]


def _data(rank, n, dtype, offset=0):
    return (torch.arange(n) + rank + offset).to(dtype)


def _sum_over_ranks(ws, n, dtype):
    return sum(_data(r, n, torch.float64) for r in range(ws)).to(dtype)


def _assert_avg(actual, expected, ws, what):
    """AVG of small integers (exact in every dtype here) by ws: scaled before or after the exact
    sum, at most ws + 1 roundings of the result's size: ws·eps(dtype) relative (tests/numerics.py)."""
    bound = ws * torch.finfo(actual.dtype).eps * expected.abs()
    assert ((actual.double() - expected).abs() <= bound).all(), f"{what}: got {actual.tolist()} expected {expected.tolist()}"


def _assert_eq(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.equal(actual, expected), f"{what}: got {actual.tolist()} expected {expected.tolist()}"


def _all_reduce_checks(rank, ws, dtype):
    n = 5
    ref = [_data(r, n, torch.float64) for r in range(ws)]
    expected = {
        pynccl.ReduceOp.SUM: sum(ref),
        pynccl.ReduceOp.MAX: torch.stack(ref).max(0).values,
        pynccl.ReduceOp.MIN: torch.stack(ref).min(0).values,
    }
    if dtype not in (torch.int8, torch.uint8, torch.float16, torch.bfloat16) or ws <= 2:
        expected[pynccl.ReduceOp.PRODUCT] = torch.stack(ref).prod(0)
    if dtype.is_floating_point:
        expected[pynccl.ReduceOp.AVG] = sum(ref) / ws
    for op, exp in expected.items():
        t = _data(rank, n, dtype)
        pynccl.all_reduce(t, op=op)
        if dtype.is_floating_point and op == pynccl.ReduceOp.AVG:
            _assert_avg(t, exp, ws, f"all_reduce AVG {dtype}")
        else:
            _assert_eq(t, exp.to(dtype), f"all_reduce {op.name} {dtype}")
    if dtype.is_floating_point:
        # Halves of small integers and their sums are exact in every float dtype here.
        t = _data(rank, n, dtype)
        pynccl.all_reduce(t, op=pynccl.ReduceOp.premul_sum(0.5))
        _assert_eq(t, (sum(ref) * 0.5).to(dtype), f"all_reduce premul_sum(0.5) {dtype}")
    # async: the Work completes the op; AVG's division happens at wait().
    t = _data(rank, n, dtype)
    work = pynccl.all_reduce(t, async_op=True)
    assert work.wait() is True and work.is_completed()
    _assert_eq(t, expected[pynccl.ReduceOp.SUM].to(dtype), f"async all_reduce {dtype}")


def _rooted_checks(rank, ws, dtype):
    n = 4
    for root in range(ws):
        t = _data(rank, n, dtype)
        pynccl.broadcast(t, src=root)
        _assert_eq(t, _data(root, n, dtype), f"broadcast root {root}")

        t = _data(rank, n, dtype)
        pynccl.reduce(t, dst=root)
        if rank == root:
            _assert_eq(t, _sum_over_ranks(ws, n, dtype), f"reduce root {root}")

        gather_list = [torch.zeros(n, dtype=dtype) for _ in range(ws)] if rank == root else None
        pynccl.gather(_data(rank, n, dtype), gather_list, dst=root)
        if rank == root:
            for r in range(ws):
                _assert_eq(gather_list[r], _data(r, n, dtype), f"gather from {r}")

        out = torch.zeros(n, dtype=dtype)
        scatter_list = [_data(r, n, dtype, offset=10) for r in range(ws)] if rank == root else None
        pynccl.scatter(out, scatter_list, src=root)
        _assert_eq(out, _data(rank, n, dtype, offset=10), f"scatter to {rank}")


def _gather_scatter_checks(rank, ws, dtype):
    n = 3
    outs = [torch.zeros(n, dtype=dtype) for _ in range(ws)]
    pynccl.all_gather(outs, _data(rank, n, dtype))
    for r in range(ws):
        _assert_eq(outs[r], _data(r, n, dtype), "all_gather")

    out = torch.zeros(ws * n, dtype=dtype)
    pynccl.all_gather_into_tensor(out, _data(rank, n, dtype))
    _assert_eq(out, torch.cat([_data(r, n, dtype) for r in range(ws)]), "all_gather_into_tensor")

    # reduce-scatter: chunk i of every rank's input is summed into rank i.
    inp = torch.cat([_data(rank, n, dtype, offset=i) for i in range(ws)])
    out = torch.zeros(n, dtype=dtype)
    pynccl.reduce_scatter_tensor(out, inp)
    expected = sum(_data(r, n, torch.float64, offset=rank) for r in range(ws)).to(dtype)
    _assert_eq(out, expected, "reduce_scatter_tensor")

    out = torch.zeros(n, dtype=dtype)
    pynccl.reduce_scatter(out, [_data(rank, n, dtype, offset=i) for i in range(ws)])
    _assert_eq(out, expected, "reduce_scatter")

    if dtype.is_floating_point:
        out = torch.zeros(n, dtype=dtype)
        pynccl.reduce_scatter_tensor(out, inp.clone(), op=pynccl.ReduceOp.AVG)
        _assert_avg(out, expected.double() / ws, ws, "reduce_scatter_tensor AVG")

    # all_to_all: rank r sends value 100*r + dst to dst.
    ins = [torch.full((2,), 10 * rank + dst, dtype=dtype) for dst in range(ws)]
    outs = [torch.zeros(2, dtype=dtype) for _ in range(ws)]
    pynccl.all_to_all(outs, ins)
    for src in range(ws):
        _assert_eq(outs[src], torch.full((2,), 10 * src + rank, dtype=dtype), f"all_to_all from {src}")

    inp = torch.cat(ins)
    out = torch.zeros(2 * ws, dtype=dtype)
    pynccl.all_to_all_single(out, inp)
    _assert_eq(out, torch.cat([torch.full((2,), 10 * s + rank, dtype=dtype) for s in range(ws)]), "a2a single")

    # Uneven splits: rank r sends (dst + 1) rows to dst, so it receives (r + 1) rows from each.
    in_splits = [d + 1 for d in range(ws)]
    inp = torch.cat([torch.full((d + 1, 2), 10 * rank + d, dtype=dtype) for d in range(ws)])
    out = torch.zeros((rank + 1) * ws, 2, dtype=dtype)
    pynccl.all_to_all_single(out, inp, [rank + 1] * ws, in_splits)
    exp = torch.cat([torch.full((rank + 1, 2), 10 * s + rank, dtype=dtype) for s in range(ws)])
    _assert_eq(out, exp, "a2a single uneven")


def _p2p_checks(rank, ws, dtype):
    if ws == 1:
        return
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    buf = torch.zeros(6, dtype=dtype)
    ops = [pynccl.P2POp(pynccl.isend, _data(rank, 6, dtype), nxt),
           pynccl.P2POp(pynccl.irecv, buf, prv)]
    for w in pynccl.batch_isend_irecv(ops):
        w.wait()
    _assert_eq(buf, _data(prv, 6, dtype), "batch_isend_irecv ring")
    # blocking send/recv, even ranks send first
    if ws % 2 == 0 or True:
        buf = torch.zeros(6, dtype=dtype)
        if rank == 0:
            pynccl.send(_data(rank, 6, dtype), dst=1)
        elif rank == 1:
            pynccl.recv(buf, src=0)
            _assert_eq(buf, _data(0, 6, dtype), "send/recv")
    buf = torch.zeros(6, dtype=dtype)
    works = [pynccl.isend(_data(rank, 6, dtype), nxt), pynccl.irecv(buf, prv)]
    for w in works:
        w.wait()
    _assert_eq(buf, _data(prv, 6, dtype), "isend/irecv")


def every_op_case(rank, ws):
    for dtype in DTYPES:
        _all_reduce_checks(rank, ws, dtype)
        _rooted_checks(rank, ws, dtype)
        _gather_scatter_checks(rank, ws, dtype)
        _p2p_checks(rank, ws, dtype)
    pynccl.barrier()

    # Sub-groups: global ranks as src/dst, group-local results.
    if ws >= 2:
        evens = pynccl.new_group([r for r in range(ws) if r % 2 == 0])
        odds = pynccl.new_group([r for r in range(ws) if r % 2 == 1])
        mine = evens if rank % 2 == 0 else odds
        t = torch.tensor([float(rank)])
        pynccl.all_reduce(t, group=mine)
        assert t.item() == sum(r for r in range(ws) if r % 2 == rank % 2)
        assert pynccl.get_world_size(mine) == len(mine.ranks)
        assert pynccl.get_rank(mine) == mine.ranks.index(rank)
        src = mine.ranks[-1]
        t = torch.tensor([float(rank)])
        pynccl.broadcast(t, src=src, group=mine)
        assert t.item() == src
        # As torch: the other group is GroupMember.NON_GROUP_MEMBER here; ops on it are skipped.
        other = odds if mine is evens else evens
        assert other is pynccl.GroupMember.NON_GROUP_MEMBER and pynccl.get_rank(other) == -1
        t = torch.ones(1)
        with pytest.warns(UserWarning, match="does not belong to the given group"):
            assert pynccl.all_reduce(t, group=other) is None
        assert t.item() == 1.0
        pynccl.destroy_process_group(evens)
        pynccl.destroy_process_group(odds)

    objs = [None] * ws
    pynccl.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(ws)]
    lst = [rank, "x"] if rank == 0 else [None, None]
    pynccl.broadcast_object_list(lst, src=0)
    assert lst == [0, "x"]
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_op_every_dtype(world_size):
    assert run_multiprocess(every_op_case, world_size, timeout=240) == ["ok"] * world_size
