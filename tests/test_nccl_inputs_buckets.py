"""One-GPU NCCL input errors raised before NCCL is called, and the fused bucket kernels
(pack/unpack, reduce_bucket) against torch."""
import pytest
import torch

from pynccl.comm.reduce_op import ReduceOp
from nccl_single_gpu_common import GPU_MARKS, C, FLOATS, make, gpu_sleep, comm  # noqa: F401 (fixtures)

pytestmark = GPU_MARKS

# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_before_nccl(comm):
    t = torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match=r"^all_reduce: expected a CUDA tensor on cuda:0 for the nccl backend, "
                                         r"got a tensor on cpu"):
        comm.all_reduce(torch.ones(4))
    with pytest.raises(ValueError, match="must be contiguous"):
        comm.all_reduce(torch.ones(4, 4, device="cuda").t())
    with pytest.raises(TypeError, match="not supported by the nccl backend"):
        comm.all_reduce(torch.ones(4, device="cuda", dtype=torch.complex32))
    with pytest.raises(ValueError, match=r"ReduceOp.AVG needs a floating-point tensor, got Int"):
        comm.all_reduce(torch.ones(4, device="cuda", dtype=torch.int32), ReduceOp.AVG)
    with pytest.raises(ValueError, match="op must be a pynccl.ReduceOp"):
        comm.all_reduce(t, 9)
    with pytest.raises(TypeError, match="op must be a pynccl.ReduceOp"):
        comm.all_reduce(t, "sum")
    with pytest.raises(TypeError, match="dtype"):
        comm.all_gather_into_tensor(torch.empty(4, device="cuda", dtype=torch.float16), t)
    with pytest.raises(ValueError, match=r"output has 3 elements, expected world_size\(1\) \u00d7 input\(4\) = 4"):
        comm.all_gather_into_tensor(torch.empty(3, device="cuda"), t)
    with pytest.raises(ValueError, match=r"root 1 is out of range for a communicator of world_size 1"):
        comm.broadcast(t, 1)
    with pytest.raises(ValueError, match=r"output_list has 2 tensors, expected world_size\(1\)"):
        comm.all_gather([t, t.clone()], t)
    with pytest.raises(ValueError, match="split_sizes sum to 3"):
        comm.all_to_all_single(t.clone(), t, None, [3])
    with pytest.raises(ValueError, match="is this rank"):
        comm.send(t, 0)
    with pytest.raises(ValueError, match="ops is empty"):
        comm.batch_isend_irecv([])
    assert not comm.is_aborted()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU for a tensor on another device")
def test_tensor_on_another_device(comm):
    with pytest.raises(ValueError, match="expected a CUDA tensor on cuda:0 for the nccl backend, got a tensor on cuda:1"):
        comm.all_reduce(torch.ones(4, device="cuda:1"))


# ----------------------------------------------------------------------------- bucket kernels
def _reference(x, dtype, scale):
    compute = torch.float64 if torch.float64 in (x.dtype, dtype) else torch.float32
    return (x.to(compute) * scale).to(dtype) if scale != 1.0 else x.to(dtype)


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("flat_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_pack_unpack_match_torch(src_dtype, flat_dtype, scale):
    torch.manual_seed(0)
    sizes = [1, 7, 0, 4096, 33, 100_003, 5, 1024]  # odd sizes misalign later segments: scalar path too
    tensors = [torch.randn(s, device="cuda").to(src_dtype) for s in sizes]
    flat = torch.full((sum(sizes) + 9,), -1.0, device="cuda").to(flat_dtype)
    C.pack(tensors, flat, scale)
    expected = torch.cat([_reference(t, flat_dtype, scale) for t in tensors])
    torch.cuda.synchronize()
    assert torch.equal(flat[: expected.numel()], expected)
    assert torch.equal(flat[expected.numel():], torch.full((9,), -1.0, device="cuda").to(flat_dtype))
    outs = [torch.empty_like(t) for t in tensors]
    C.unpack(flat, outs, scale)
    offset = 0
    torch.cuda.synchronize()
    for t, o in zip(tensors, outs):
        assert torch.equal(o, _reference(flat[offset: offset + t.numel()], src_dtype, scale))
        offset += t.numel()


def test_pack_many_tensors_and_raw_dtypes():
    tensors = [torch.arange(i + 1, device="cuda", dtype=torch.int64) for i in range(300)]  # > 120 per launch
    flat = torch.empty(sum(t.numel() for t in tensors), device="cuda", dtype=torch.int64)
    C.pack(tensors, flat)
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat(tensors))
    outs = [torch.zeros_like(t) for t in tensors]
    C.unpack(flat, outs)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))
    b = torch.tensor([True, False, True], device="cuda")
    fb = torch.zeros(3, dtype=torch.bool, device="cuda")
    C.pack([b], fb)
    torch.cuda.synchronize()
    assert torch.equal(fb, b)


def test_pack_validation_errors():
    flat = torch.zeros(10, device="cuda")
    with pytest.raises(ValueError, match="tensors hold 12 elements in total, but flat has 10"):
        C.pack([torch.ones(6, device="cuda"), torch.ones(6, device="cuda")], flat, 1.0)
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype"):
        C.pack([torch.ones(2, device="cuda"), torch.ones(2, device="cuda", dtype=torch.float16)], flat, 1.0)
    with pytest.raises(ValueError, match="needs floating-point"):
        C.pack([torch.ones(2, device="cuda", dtype=torch.int32)], torch.zeros(4, device="cuda", dtype=torch.int32), 0.5)
    with pytest.raises(TypeError, match="cannot cast"):
        C.pack([torch.ones(2, device="cuda", dtype=torch.int32)], flat, 1.0)
    with pytest.raises(ValueError, match="must be contiguous"):
        C.unpack(flat, [torch.ones(4, 4, device="cuda").t()], 1.0)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        C.pack([torch.ones(2)], flat, 1.0)


def test_reduce_bucket_orders_its_streams(comm):
    """One DDP bucket in one call: the pack (scale and cast fused) waits for gradients still being
    made on the current stream, the all-reduce for the pack; Work.wait() orders the caller after both."""
    pack_stream = torch.cuda.Stream(priority=-1)
    # NOTE: the first pack and all-reduce load their kernels (lazily, synchronously: this test
    # failed when run first in its module, session 15): once before the timed part, same dtypes.
    comm.reduce_bucket([torch.zeros(8, device="cuda")], torch.zeros(8, device="cuda", dtype=torch.bfloat16), 1.0,
                       pack_stream.cuda_stream).wait()
    sizes = [5, 4096, 1, 333]
    base = [make(torch.float32, n, offset=i) for i, n in enumerate(sizes)]
    _ = [g * 2 for g in base]                     # the multiply's kernel loaded before the timed part too
    gpu_sleep(0.1)                                # gpu_sleep calibrated (once per process)
    torch.cuda.synchronize()
    flat = torch.full((sum(sizes),), -7.0, device="cuda", dtype=torch.bfloat16)     # a bf16 wire
    gpu_sleep(0.2)
    grads = [g * 2 for g in base]                 # queued behind the sleep
    seq = comm.seq
    work = comm.reduce_bucket(grads, flat, 0.25, pack_stream.cuda_stream)
    assert isinstance(work, C.Work) and work.op == "reduce_bucket" and comm.seq == seq + 1
    assert not work.is_completed()                # still behind the sleeping current stream
    work.wait()
    seen = flat.clone()                           # ordered after the all-reduce by wait()
    torch.cuda.synchronize()
    expected = torch.cat([(g * 0.5).to(torch.bfloat16) for g in base])   # world size 1: SUM is the identity
    assert torch.equal(seen, expected) and torch.equal(flat, expected)

    # Gradients that already are the buffer (bucket views): scale 1 copies nothing, else in place.
    flat32 = torch.cat(base)
    views = list(flat32.split(sizes))
    comm.reduce_bucket(views, flat32, 1.0, pack_stream.cuda_stream).wait()
    comm.reduce_bucket(views, flat32, 0.5, pack_stream.cuda_stream).wait()
    torch.cuda.synchronize()
    assert torch.equal(flat32, torch.cat(base) * 0.5)


@pytest.mark.parametrize("split_all_reduce", [False, True, "all_to_all"])
def test_reduce_bucket_unpacks_after_the_all_reduce_in_slices(comm, split_all_reduce):
    """unpack_stream: the reduced (bf16) wire is cast back into the grads on that stream, after
    the all-reduce, which is after the pack, which waits for the grads; chunks slices all three
    (64 asks for more slices than 256-element alignment allows, so tensors are cut mid-way).
    "all_to_all": the reduce-scatter as an all-to-all into a scratch of 512 elements (NaN-filled:
    a slice summed from outside what the all-to-all wrote shows) and a local sum, so the 6435
    elements also go through it in slices."""
    pack_stream, unpack_stream = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)
    sizes = [5, 4096, 1, 333, 2000]
    base = [make(torch.float32, n, offset=i) for i, n in enumerate(sizes)]
    scratch = None
    if split_all_reduce == "all_to_all":
        split_all_reduce, scratch = True, torch.full((512,), float("nan"), device="cuda", dtype=torch.bfloat16)
        # NOTE: NCCL sets up its all-to-all at the first call, synchronously (the sleep below would
        # be over before the call returned): once beforehand, then the NaN fill again.
        comm.reduce_bucket([torch.zeros(512, device="cuda")], torch.zeros(512, device="cuda", dtype=torch.bfloat16),
                           1.0, pack_stream.cuda_stream, True, 0, 1, scratch).wait()
        scratch.fill_(float("nan"))
    for chunks in (1, 3, 64):
        flat = torch.full((sum(sizes),), -7.0, device="cuda", dtype=torch.bfloat16)
        gpu_sleep(0.2)
        grads = [g * 2 for g in base]             # queued behind the sleep
        seq = comm.seq
        work = comm.reduce_bucket(grads, flat, 0.25, pack_stream.cuda_stream, split_all_reduce,
                                  unpack_stream.cuda_stream, chunks, scratch)
        assert comm.seq == seq + 1 and not work.is_completed()
        work.wait()
        seen = [g.clone() for g in grads]         # ordered after the unpack by wait()
        torch.cuda.synchronize()
        for i, (s, g) in enumerate(zip(seen, base)):   # world size 1: SUM is the identity
            assert torch.equal(s, g * 0.5), f"chunks={chunks}: grads[{i}]"
        assert torch.equal(flat, torch.cat([(g * 0.5).to(torch.bfloat16) for g in base]))


@pytest.mark.parametrize("form", ["reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_reduce_bucket_copy_pack_scales_the_shard(comm, form, grad_dtype):
    """copy_pack: the grads reach flat unscaled (copy engines; a bf16 gradient through torch's
    cast kernel; a gradient that already is its slot of flat is not copied) after the grads'
    stream (they are queued behind a sleep), and the reduced shard takes the scale, whole or in
    slices, through a NaN-filled scratch for the all-to-all form: flat ends as the scaled sum."""
    pack_stream = torch.cuda.Stream(priority=-1)
    sizes = [5, 4096, 1, 333, 2000]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    base = [make(torch.float32, n, offset=i) for i, n in enumerate(sizes)]
    scratch = None
    if form == "all_to_all":
        scratch = torch.full((512,), float("nan"), device="cuda")
        comm.reduce_bucket([torch.zeros(512, device="cuda")], torch.zeros(512, device="cuda"), 1.0,
                           pack_stream.cuda_stream, True, 0, 1, scratch, True).wait()   # NCCL's set-up, once
        scratch.fill_(float("nan"))
    for chunks in (1, 3):
        flat = torch.full((sum(sizes),), -7.0, device="cuda")
        gpu_sleep(0.2)
        grads = [(g * 2).to(grad_dtype) for g in base]             # queued behind the sleep
        if grad_dtype == torch.float32:                          # one gradient is its own slot already
            grads[3] = flat[offsets[3]: offsets[3] + sizes[3]]
            grads[3].copy_(base[3] * 2)
        comm.reduce_bucket(grads, flat, 0.25, pack_stream.cuda_stream, True, 0, chunks, scratch, True).wait()
        torch.cuda.synchronize()
        assert torch.equal(flat, torch.cat([g * 0.5 for g in base])), f"chunks={chunks}"
        for i, g in enumerate(grads):
            if i != 3 or grad_dtype != torch.float32:
                assert torch.equal(g.float(), base[i] * 2), f"chunks={chunks}: grads[{i}] changed"


def test_reduce_bucket_checks_before_enqueueing(comm):
    s = torch.cuda.Stream().cuda_stream
    flat = torch.zeros(8, device="cuda")
    seq = comm.seq
    with pytest.raises(TypeError, match=r"reduce_bucket: tensors\[1\] has dtype"):
        comm.reduce_bucket([torch.ones(2, device="cuda"), torch.ones(2, device="cuda", dtype=torch.half)], flat, 1.0, s)
    with pytest.raises(ValueError, match="reduce_bucket: tensors hold 9 elements in total, but flat has 8"):
        comm.reduce_bucket([torch.ones(4, device="cuda"), torch.ones(5, device="cuda")], flat, 1.0, s)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        comm.reduce_bucket([torch.ones(2)], flat, 1.0, s)
    with pytest.raises(ValueError, match="must be a side stream"):
        comm.reduce_bucket([torch.ones(2, device="cuda")], flat, 1.0, 0)
    with pytest.raises(ValueError, match="reduce_bucket: chunks must be >= 1, got 0"):
        comm.reduce_bucket([torch.ones(2, device="cuda")], flat, 1.0, s, False, s, 0)
    grads8 = [torch.ones(8, device="cuda")]
    with pytest.raises(ValueError, match=r"reduce_bucket: scratch \(the all-to-all form of the reduce-scatter\) "
                                         r"needs split_all_reduce=True"):
        comm.reduce_bucket(grads8, flat, 1.0, s, False, 0, 1, torch.zeros(8, device="cuda"))
    with pytest.raises(TypeError, match="reduce_bucket: scratch has dtype BFloat16, flat has Float; they must match"):
        comm.reduce_bucket(grads8, flat, 1.0, s, True, 0, 1, torch.zeros(8, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"reduce_bucket: scratch has 100 elements; it needs at least min\(flat's "
                                         r"1000, 256 x world_size = 256\)"):
        comm.reduce_bucket([torch.ones(1000, device="cuda")], torch.zeros(1000, device="cuda"), 1.0, s, True, 0, 1,
                           torch.zeros(100, device="cuda"))
    with pytest.raises(ValueError, match=r"reduce_bucket: expected a CUDA tensor on cuda:0 for the nccl backend, got "
                                         r"a tensor on cpu \(scratch\)"):
        comm.reduce_bucket(grads8, flat, 1.0, s, True, 0, 1, torch.zeros(8))
    with pytest.raises(ValueError, match=r"reduce_bucket: copy_pack \(the shard scaled between the reduce-scatter "
                                         r"and the all-gather\) needs split_all_reduce=True"):
        comm.reduce_bucket(grads8, flat, 0.5, s, False, 0, 1, None, True)
    assert comm.seq == seq                        # nothing was enqueued
