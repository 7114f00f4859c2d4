"""Random collective calls, valid and invalid, for tests/test_fuzz.py (gloo) and the GPU suite (nccl).

Every rank draws the same sequence from one seed, so valid calls match across ranks; each
valid call's result is checked against closed-form values, each invalid call must raise a
Python exception (ValueError, TypeError or RuntimeError) before any communication.
"""
import random

import torch

import pynccl

VALID_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "gather", "scatter", "barrier", "sendrecv"]
INVALID = ["device", "dtype", "root", "size", "dtype_mismatch", "noncontiguous", "redop", "bad_op_value",
           "destroyed", "not_a_tensor", "huge_count", "splits"]


def _val(rank, n, dtype, device, k=0):
    # Values small enough for int8 sums over 4 ranks.
    return ((torch.arange(n) + rank + k) % 7).to(dtype).to(device)


def _sum(ws, n, dtype, device, k=0):
    return sum(((torch.arange(n) + r + k) % 7).double() for r in range(ws)).to(dtype).to(device)


def _valid_call(rng, rank, ws, device):
    op = rng.choice(OPS)
    dtype = rng.choice(VALID_DTYPES)
    n = rng.choice([0, 1, 3, 16, 257])
    root = rng.randrange(ws)
    if op == "all_reduce":
        t = _val(rank, n, dtype, device)
        redop = rng.choice([pynccl.ReduceOp.SUM, pynccl.ReduceOp.MAX, pynccl.ReduceOp.MIN])
        pynccl.all_reduce(t, op=redop)
        stack = torch.stack([_val(r, n, torch.float64, "cpu") for r in range(ws)]) if n else None
        if redop == pynccl.ReduceOp.SUM:
            exp = _sum(ws, n, dtype, device)
        elif n:
            exp = (stack.max(0).values if redop == pynccl.ReduceOp.MAX else stack.min(0).values).to(dtype).to(device)
        else:
            exp = t
        assert torch.equal(t, exp), (op, dtype, n, redop)
    elif op == "broadcast":
        t = _val(rank, n, dtype, device)
        pynccl.broadcast(t, src=root)
        assert torch.equal(t, _val(root, n, dtype, device)), (op, dtype, n)
    elif op == "reduce":
        t = _val(rank, n, dtype, device)
        pynccl.reduce(t, dst=root)
        if rank == root:
            assert torch.equal(t, _sum(ws, n, dtype, device)), (op, dtype, n)
    elif op == "all_gather":
        outs = [torch.zeros(n, dtype=dtype, device=device) for _ in range(ws)]
        pynccl.all_gather(outs, _val(rank, n, dtype, device))
        assert all(torch.equal(outs[r], _val(r, n, dtype, device)) for r in range(ws)), (op, dtype, n)
    elif op == "all_gather_into_tensor":
        out = torch.zeros(n * ws, dtype=dtype, device=device)
        pynccl.all_gather_into_tensor(out, _val(rank, n, dtype, device))
        assert torch.equal(out, torch.cat([_val(r, n, dtype, device) for r in range(ws)])), (op, dtype, n)
    elif op == "reduce_scatter_tensor":
        inp = torch.cat([_val(rank, n, dtype, device, k) for k in range(ws)])
        out = torch.zeros(n, dtype=dtype, device=device)
        pynccl.reduce_scatter_tensor(out, inp)
        assert torch.equal(out, _sum(ws, n, dtype, device, rank)), (op, dtype, n)
    elif op == "all_to_all_single":
        inp = torch.cat([torch.full((n,), (rank + d) % 7, dtype=dtype) for d in range(ws)]).to(device)
        out = torch.zeros(n * ws, dtype=dtype, device=device)
        pynccl.all_to_all_single(out, inp)
        exp = torch.cat([torch.full((n,), (s + rank) % 7, dtype=dtype) for s in range(ws)]).to(device)
        assert torch.equal(out, exp), (op, dtype, n)
    elif op == "gather":
        lst = [torch.zeros(n, dtype=dtype, device=device) for _ in range(ws)] if rank == root else None
        pynccl.gather(_val(rank, n, dtype, device), lst, dst=root)
        if rank == root:
            assert all(torch.equal(lst[r], _val(r, n, dtype, device)) for r in range(ws)), (op, dtype, n)
    elif op == "scatter":
        lst = [_val(r, n, dtype, device, 3) for r in range(ws)] if rank == root else None
        out = torch.zeros(n, dtype=dtype, device=device)
        pynccl.scatter(out, lst, src=root)
        assert torch.equal(out, _val(rank, n, dtype, device, 3)), (op, dtype, n)
    elif op == "barrier":
        pynccl.barrier()
    elif op == "sendrecv" and ws > 1 and n:
        buf = torch.zeros(n, dtype=dtype, device=device)
        works = pynccl.batch_isend_irecv([pynccl.P2POp(pynccl.isend, _val(rank, n, dtype, device), (rank + 1) % ws),
                                          pynccl.P2POp(pynccl.irecv, buf, (rank - 1) % ws)])
        for w in works:
            w.wait()
        assert torch.equal(buf, _val((rank - 1) % ws, n, dtype, device)), (op, dtype, n)


def _invalid_call(rng, rank, ws, device, destroyed_group):
    kind = rng.choice(INVALID)
    other_device = "meta"
    t = torch.ones(8, device=device)
    if kind == "device":
        pynccl.all_reduce(torch.ones(8, device=other_device))
    elif kind == "dtype":
        # NOTE: NCCL moves complex and bool tensors as bytes (broadcast of them is valid); complex32
        # and the quantised types have no reduction on either backend.
        pynccl.all_reduce(torch.ones(4, dtype=torch.complex32).to(device))
    elif kind == "root":
        bad = rng.choice([ws, -1, 10 ** 9, ws + 3])
        rng.choice([lambda: pynccl.broadcast(t, src=bad), lambda: pynccl.reduce(t, dst=bad),
                    lambda: pynccl.gather(t, None, dst=bad), lambda: pynccl.send(t, dst=bad)])()
    elif kind == "size":
        pynccl.all_gather_into_tensor(torch.zeros(8 * ws + rng.choice([-1, 1, 5]), device=device), t)
    elif kind == "dtype_mismatch":
        pynccl.reduce_scatter_tensor(torch.zeros(8, dtype=torch.float64, device=device),
                                     torch.zeros(8 * ws, device=device))
    elif kind == "noncontiguous":
        pynccl.all_reduce(torch.ones(6, 4, device=device).t())
    elif kind == "redop":
        pynccl.all_reduce(torch.ones(4, dtype=torch.int32, device=device), op=pynccl.ReduceOp.AVG)
    elif kind == "bad_op_value":
        pynccl.all_reduce(t, op=rng.choice([99, -1, "sum"]))
    elif kind == "destroyed":
        pynccl.all_reduce(t, group=destroyed_group)
    elif kind == "not_a_tensor":
        pynccl.broadcast(rng.choice([[1.0], None, 3.0, "x"]), src=0)
    elif kind == "huge_count":
        pynccl.all_reduce(torch.zeros(1, device=device).expand(2 ** 40))
    elif kind == "splits":
        pynccl.all_to_all_single(torch.zeros(4 * ws, device=device), torch.zeros(4 * ws, device=device),
                                 [2 ** 62] + [0] * (ws - 1), None)
    return kind


def run_fuzz(rank, ws, num_calls, seed, device):
    rng = random.Random(seed)
    destroyed = pynccl.new_group(list(range(ws)))
    pynccl.destroy_process_group(destroyed)
    counts = {"valid": 0, "invalid": 0}
    for i in range(num_calls):
        if rng.random() < 0.5:
            _valid_call(rng, rank, ws, device)
            counts["valid"] += 1
        else:
            try:
                kind = _invalid_call(rng, rank, ws, device, destroyed)
            except (ValueError, TypeError, RuntimeError):
                counts["invalid"] += 1
            else:
                raise AssertionError(f"call #{i} ({kind}) was invalid but raised nothing")
    pynccl.barrier()
    return counts
