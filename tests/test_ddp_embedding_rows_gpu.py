"""DistributedDataParallel(tied_embedding_rows=True) on NCCL (issue 26): the tied LM of
test_ddp_embedding_rows.py on CUDA, against torch DDP on torch's own NCCL group, with every
comm_path, with gradient copies and bucket views (the default; zeroed in place and set to None),
each with SGD (linear in the gradient: a lost rank's
rows or a missed 1/N moves parameters by a step's worth) and AdamW. The head's part is packed on
the reducer's side stream while backward goes on, the rest's counts and rows cross through
pynccl's stream at the end: a stream ordering bug would read a part before it is written and fail
these comparisons.
Tolerance: test_ddp_embedding_rows._grad_rtol (the order of the final sums), through
numerics.trained_atol for the optimizer."""
import pytest
import torch

from pynccl.testing import run_multiprocess
from test_ddp_embedding_rows import BATCH, SEQ, _batches, _grad_rtol, _model

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _against_torch(rank, ws):
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within, record_grad_scale, trained_atol

    device = pynccl.get_device()
    torch_pg = tdist.new_group(backend="nccl")
    data = [(i.to(device), t.to(device)) for i, t in _batches(rank, seq=SEQ - rank)]   # uneven token counts
    rtol = _grad_rtol(ws, BATCH * SEQ)
    failures = []
    rows = dict(tied_embedding_rows=True)
    # NOTE: the last: bucket views (the default) zeroed with set_to_none=True, as nanoGPT's train.py does.
    for kw in (dict(rows, comm_path="default", gradient_as_bucket_view=False),
               dict(rows, comm_path="symmetric", gradient_as_bucket_view=False),
               dict(rows, comm_path="copy_engine", gradient_as_bucket_view=False),
               dict(rows, gradient_as_bucket_view=True), rows):
        for opt in ("plain-sgd", "adamw"):
            ours = pynccl.DistributedDataParallel(_model().to(device), bucket_cap_mb=0.001, **kw)
            assert ours.reducer.tied_rows is not None
            ref = torch.nn.parallel.DistributedDataParallel(_model().to(device), process_group=torch_pg,
                                                            bucket_cap_mb=0.001)
            make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if opt == "plain-sgd" else \
                (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01))
            o_ours, o_ref = make(ours.parameters()), make(ref.parameters())
            scale = {}
            for idx, tgt in data:
                for m, o in ((ours, o_ours), (ref, o_ref)):
                    o.zero_grad(set_to_none=kw.get("gradient_as_bucket_view") is not True)
                    m(idx, tgt).backward()
                assert ours.reducer.tied_rows.last_exchange == "rows"
                record_grad_scale(ref.module.parameters(), scale)
                o_ours.step()
                o_ref.step()
            torch.cuda.synchronize()
            # the rows went through the symmetric window wherever the buckets have one
            made = isinstance(ours.reducer.tied_rows._windows[0], torch.Tensor)
            assert made == (ours.reducer.comm_path.name != "default"), f"{kw}: rows window made: {made}"
            try:
                for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
                    assert_within(p, q, trained_atol(o_ref, q, rtol, scale.get(q), len(data)), f"{kw} {opt} {name}")
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, "\n".join(failures)
    return True


def _captured_after_tied_steps(rank, ws):
    """The default constructor on the tied LM: 3 eager steps on a side stream (the tail acts), then
    the step captured in a CUDA graph (the tail steps aside) and replayed, against torch DDP eager on
    the same batches. Session 14: the path kept the weight's AccumulateGrad node alive from
    construction, so autograd made the capturing stream wait for the legacy stream and capture failed
    (cudaErrorStreamCaptureImplicit)."""
    import torch.distributed as tdist
    import pynccl
    from numerics import assert_within, record_grad_scale, trained_atol

    device = pynccl.get_device()
    torch_pg = tdist.new_group(backend="nccl")
    data = [(i.to(device), t.to(device)) for i, t in _batches(rank, n=6)]
    ours = pynccl.DistributedDataParallel(_model().to(device), bucket_cap_mb=0.001)
    ref = torch.nn.parallel.DistributedDataParallel(_model().to(device), process_group=torch_pg, bucket_cap_mb=0.001)
    o_ours, o_ref = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scale = {}
    for idx, tgt in data:
        o_ref.zero_grad(set_to_none=True)
        ref(idx, tgt).backward()
        record_grad_scale(ref.module.parameters(), scale)
        o_ref.step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for idx, tgt in data[:3]:
            o_ours.zero_grad(set_to_none=True)
            ours(idx, tgt).backward()
            assert ours.reducer.tied_rows.last_exchange == "rows"
            o_ours.step()
    torch.cuda.current_stream().wait_stream(side)
    static_idx, static_tgt = data[3][0].clone(), data[3][1].clone()
    o_ours.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours(static_idx, static_tgt).backward()
        o_ours.step()
    assert ours.reducer.tied_rows is None            # stepped aside at capture
    for idx, tgt in data[3:]:
        static_idx.copy_(idx)
        static_tgt.copy_(tgt)
        graph.replay()
    torch.cuda.synchronize()
    rtol = _grad_rtol(ws, BATCH * SEQ)
    for (name, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        assert_within(p, q, trained_atol(o_ref, q, rtol, scale.get(q), len(data)), f"captured {name}")
    return True


@pytest.mark.multigpu
@needs_2_gpus
def test_tied_model_captured_after_eager_steps():
    assert run_multiprocess(_captured_after_tied_steps, 2, backend="nccl", start_method="spawn",
                            timeout=300) == [True, True]


@pytest.mark.multigpu
@needs_2_gpus
def test_tied_embedding_rows_equal_torch_ddp_on_nccl():
    assert run_multiprocess(_against_torch, 2, backend="nccl", start_method="spawn", timeout=300) == [True, True]
