"""torch's ReduceOp objects passed to pynccl (issue 25): every op, in every form a torch user
writes it (`ReduceOp.MAX`, `ReduceOp(ReduceOp.MAX)`, `_make_nccl_premul_sum(f)`), through every
entry point that takes an op (all_reduce and its async form, reduce, reduce_scatter,
reduce_scatter_tensor, all_reduce_coalesced and its async form, the collective-check wrapper),
against torch.distributed's own result on the same data. The data make every op's answer
different from every other op's, so an op mapped to the wrong reduction cannot pass (the old
integer mapping read MAX as AVG and AVG as PRODUCT). The `multigpu` twin runs the same on NCCL.
"""
import pytest
import torch
import torch.distributed as tdist

import pynccl
from pynccl.comm.reduce_op import PremulSum, ReduceOp, as_reduce_op
from pynccl.testing import run_multiprocess

TR = tdist.ReduceOp
FLOAT_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
BITWISE_OPS = ["BAND", "BOR", "BXOR"]
FACTOR = 2.5


# ----------------------------------------------------------------------------- no processes
def test_values_and_equality_match_torch():
    for name, member in TR.RedOpType.__members__.items():
        if name == "UNUSED":
            continue
        ours = ReduceOp[name]
        assert int(ours) == int(member), name                  # the ints C++ reads are torch's
        assert ours == member and member == ours, name          # both directions
        assert hash(ours) == hash(member), name                 # usable as the same dict key
        if name != "PREMUL_SUM":                                # (torch builds that one only with a factor)
            assert ours == TR(member), name                     # torch's ReduceOp objects too
            assert as_reduce_op(member) is ours and as_reduce_op(TR(member)) is ours, name
    assert ReduceOp.PREMUL_SUM == tdist._make_nccl_premul_sum(FACTOR)
    assert ReduceOp.MAX != TR.AVG and ReduceOp.AVG != TR.PRODUCT and ReduceOp.MAX != TR(TR.MIN)


def test_premul_sum_forms_and_refusals():
    assert as_reduce_op(tdist._make_nccl_premul_sum(FACTOR)) == PremulSum(FACTOR)
    assert as_reduce_op(tdist._make_nccl_premul_sum(torch.tensor(FACTOR))) == PremulSum(FACTOR)
    assert as_reduce_op(ReduceOp.premul_sum(FACTOR)).factor == FACTOR
    with pytest.raises(ValueError, match="PREMUL_SUM needs its factor"):
        as_reduce_op(TR.PREMUL_SUM)
    for bad in (4, True, "max", 4.0, None):                     # torch.distributed refuses these too
        with pytest.raises(TypeError, match="op must be a pynccl.ReduceOp, a torch.distributed.ReduceOp"):
            as_reduce_op(bad, "all_reduce")


# ----------------------------------------------------------------------------- on gloo
def _forms(name):
    """The op as a torch user and a pynccl user write it."""
    if name == "PREMUL_SUM":
        return [("torch premul float", tdist._make_nccl_premul_sum(FACTOR)),
                ("torch premul tensor", tdist._make_nccl_premul_sum(torch.tensor(FACTOR))),
                ("pynccl premul", ReduceOp.premul_sum(FACTOR))]
    return [("torch RedOpType", getattr(TR, name)), ("torch ReduceOp", TR(getattr(TR, name))),
            ("pynccl", ReduceOp[name])]


def _data(rank, world_size, name, n):
    """Per-rank inputs on which SUM, AVG, PRODUCT, MIN, MAX (and BAND, BOR, BXOR) all differ,
    exactly representable (dyadic values; their products and sums stay exact in fp32)."""
    i = torch.arange(n)
    if name in BITWISE_OPS:
        return ((i + 3) * (rank + 1) + 5 * rank).to(torch.int64)
    return ((i % 4 + 1) * 0.5 + rank * 0.25 - (rank % 2) * (i % 3)).to(torch.float32)


def _torch_result(entry, name, x, world_size, dst):
    """torch.distributed's answer on the same data (gloo has no PREMUL_SUM: factor * its SUM)."""
    op, pre = getattr(TR, name), 1.0
    if name == "PREMUL_SUM":
        op, pre = TR.SUM, FACTOR
    x = x * pre if pre != 1.0 else x.clone()
    if entry == "reduce_scatter":
        out = torch.empty(x.numel() // world_size, dtype=x.dtype)
        tdist.reduce_scatter_tensor(out, x, op=op)
        return out
    tdist.all_reduce(x, op=op)       # reduce's answer on dst is all_reduce's
    return x


def _entry_points(world_size, dst):
    """(entry name, kind of torch answer, function(op, x) -> this rank's result or None)."""
    def all_reduce(op, x):
        pynccl.all_reduce(x, op=op)
        return x

    def all_reduce_async(op, x):
        pynccl.all_reduce(x, op, None, True).wait()
        return x

    def reduce(op, x):
        pynccl.reduce(x, dst, op=op)
        return x if pynccl.get_rank() == dst else None

    def reduce_scatter(op, x):
        out = torch.empty(x.numel() // world_size, dtype=x.dtype)
        pynccl.reduce_scatter(out, list(x.chunk(world_size)), op=op)
        return out

    def reduce_scatter_tensor(op, x):
        out = torch.empty(x.numel() // world_size, dtype=x.dtype)
        pynccl.reduce_scatter_tensor(out, x, op=op, async_op=True).wait()
        return out

    def coalesced(op, x):
        a, b = x[:5].clone(), x[5:].clone()
        pynccl.all_reduce_coalesced([a, b], op=op)
        return torch.cat([a, b])

    def coalesced_async(op, x):
        a, b = x[:5].clone(), x[5:].clone()
        pynccl.all_reduce_coalesced([a, b], op=op, async_op=True).wait()
        return torch.cat([a, b])

    return [("all_reduce", "all_reduce", all_reduce), ("all_reduce async", "all_reduce", all_reduce_async),
            ("reduce", "all_reduce", reduce), ("reduce_scatter", "reduce_scatter", reduce_scatter),
            ("reduce_scatter_tensor async", "reduce_scatter", reduce_scatter_tensor),
            ("all_reduce_coalesced", "all_reduce", coalesced),
            ("all_reduce_coalesced async", "all_reduce", coalesced_async)]


def _every_op_every_entry(rank, world_size, group=None):
    n, dst = 4 * world_size * 3, world_size - 1
    checked = 0
    for name in FLOAT_OPS + BITWISE_OPS:
        for entry, kind, call in _entry_points(world_size, dst):
            x = _data(rank, world_size, name, n)
            expected = _torch_result(kind, name, x, world_size, dst)
            for label, op in _forms(name):
                got = call(op, x.clone())
                if got is None:
                    continue
                assert torch.equal(got, expected), f"{entry} with {label} {name}: {got} != torch's {expected}"
                checked += 1
    # The table, verbatim: t = rank + 1 gives torch's answer for every op.
    for name, want in [("SUM", 3.0), ("MAX", 2.0), ("AVG", 1.5), ("PRODUCT", 2.0), ("MIN", 1.0)]:
        if world_size == 2:
            t = torch.tensor([rank + 1.0])
            pynccl.all_reduce(t, op=getattr(TR, name))
            assert t.item() == want, (name, t.item())
    return checked


def _with_collective_check(rank, world_size):
    # The signature check names the op by member: torch's MAX on one rank equals pynccl's MAX on
    # another, so the check passes and the op is MAX.
    x = torch.tensor([float(rank + 1)])
    pynccl.all_reduce(x, op=TR.MAX if rank % 2 else ReduceOp.MAX)
    assert x.item() == world_size
    return _every_op_every_entry(rank, world_size)


def test_every_op_and_entry_point_equals_torch_on_gloo():
    checked = run_multiprocess(_every_op_every_entry, 2)
    # 9 ops x 7 entries x 3 forms, reduce counted on its root only
    assert checked[1] == 9 * 7 * 3 and checked[0] == 9 * 6 * 3
    checked = run_multiprocess(_with_collective_check, 3, init_kwargs={"check_collectives": True})
    assert checked[2] == 9 * 7 * 3


def _nccl_every_op(rank, world_size):
    dev = torch.device("cuda", torch.cuda.current_device())
    torch_nccl = tdist.new_group(backend="nccl")            # torch's answer, on NCCL too
    n = 4 * world_size * 3
    for name in FLOAT_OPS:
        x = _data(rank, world_size, name, n).to(dev)
        want = x * FACTOR if name == "PREMUL_SUM" else x.clone()
        tdist.all_reduce(want, op=TR.SUM if name == "PREMUL_SUM" else getattr(TR, name), group=torch_nccl)
        for label, op in _forms(name):
            got = x.clone()
            pynccl.all_reduce(got, op=op)
            assert torch.equal(got, want), f"all_reduce {label} {name}: {got} != torch's {want}"
            out = torch.empty(n // world_size, device=dev)
            pynccl.reduce_scatter_tensor(out, x.clone(), op=op, async_op=True).wait()
            assert torch.equal(out, want.chunk(world_size)[rank]), f"reduce_scatter_tensor {label} {name}"
    for name in BITWISE_OPS:
        with pytest.raises(ValueError, match=f"ReduceOp.{name} is not supported by NCCL"):
            pynccl.all_reduce(torch.ones(4, dtype=torch.int64, device=dev), op=getattr(TR, name))


@pytest.mark.multigpu
def test_every_op_equals_torch_on_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_multiprocess(_nccl_every_op, 2, backend="nccl", start_method="spawn", timeout=300)


def _nccl_one_rank_backend(rank, world_size):
    # The C++ binding maps torch's objects itself (through as_reduce_op), for code that calls a
    # group's backend directly: a premul factor is applied, a bitwise op is refused by name.
    backend = pynccl.get_default_group().backend
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    for op in (TR.MAX, TR(TR.MAX), ReduceOp.MAX):
        y = x.clone()
        backend.all_reduce(y, op)
        assert torch.equal(y, x)
    y = x.clone()
    backend.all_reduce(y, tdist._make_nccl_premul_sum(FACTOR))
    assert torch.equal(y, x * FACTOR)
    with pytest.raises(ValueError, match="ReduceOp.BXOR is not supported by NCCL"):
        backend.all_reduce(torch.ones(2, dtype=torch.int32, device="cuda"), TR.BXOR)
    with pytest.raises(TypeError, match="op must be a pynccl.ReduceOp"):
        backend.all_reduce(x.clone(), "max")


@pytest.mark.gpu
def test_backend_binding_maps_torch_ops():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    run_multiprocess(_nccl_one_rank_backend, 1, backend="nccl", start_method="spawn", timeout=300)
