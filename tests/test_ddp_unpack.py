"""Which buckets pynccl DDP may unpack as soon as their all-reduce ends (reducer.unpack_early,
Reducer._unpacks_early): the decision is the same on every backend, so it is checked here on
gloo, on real buckets after a real forward; the CUDA path itself is tests/test_ddp_unpack_gpu.py."""
import torch

import pynccl
from pynccl.ddp import comm_path
from pynccl.testing import run_multiprocess
from ddp_common import TINY_BUCKETS_MB, _mlp


def _decisions(ddp, x):
    """_unpacks_early of every bucket, as it would be asked in the backward of ddp(x)."""
    out = ddp(x)                                   # prepare_for_backward: the locally unused parameters
    decided = [ddp.reducer._unpacks_early(b) for b in ddp.reducer.bucketer.buckets]
    out.sum().backward()
    return decided


def _check_decisions(rank, ws):
    x = torch.randn(4, 8)
    # `never` gets a gradient in the first backward only; from then on it is locally unused
    # (find_unused_parameters finds it) though its .grad is still set: torch leaves that as it is.
    ddp = pynccl.DistributedDataParallel(_mlp(with_never=True), bucket_cap_mb=TINY_BUCKETS_MB,
                                         find_unused_parameters=True, gradient_as_bucket_view=False)
    ddp.module.uses_never = True
    ddp(x).sum().backward()
    ddp.module.uses_never = False
    buckets = ddp.reducer.bucketer.buckets
    unused = {id(p) for p in ddp.module.never.parameters()}
    holds_unused = [not unused.isdisjoint(map(id, b.params)) for b in buckets]
    assert any(holds_unused) and not all(holds_unused) and len(buckets) > 3
    assert ddp.reducer.unpack_early is False and _decisions(ddp, x) == [False] * len(buckets)   # the default
    ddp.reducer.unpack_early = True
    assert all(p.grad is not None for b in buckets for p in b.params)
    assert _decisions(ddp, x) == [not h for h in holds_unused]
    # A bucket with a parameter whose grad was set to None (by a user's hook, say) falls back.
    i = holds_unused.index(False)
    out = ddp(x)
    buckets[i].params[0].grad = None
    assert [ddp.reducer._unpacks_early(b) for b in buckets] == [not h and j != i for j, h in enumerate(holds_unused)]
    out.sum().backward()

    # Every parameter used: every bucket early, unless the grads are bucket views (nothing to
    # unpack) or the optimizer steps in backward (optimizer_overlap.py writes back itself).
    copies = dict(gradient_as_bucket_view=False)         # NOTE: the default is views (pynccl/ddp/defaults.py)
    for kw, overlap in ((copies, False), (dict(gradient_as_bucket_view=True), False), (copies, True)):
        ddp = pynccl.DistributedDataParallel(_mlp(), bucket_cap_mb=TINY_BUCKETS_MB, **kw)
        ddp.reducer.unpack_early = True
        if overlap:
            ddp.overlap_optimizer(torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1))
        ddp(x).sum().backward()
        want = not kw["gradient_as_bucket_view"] and not overlap
        assert _decisions(ddp, x) == [want] * len(ddp.reducer.bucketer.buckets), (kw, overlap)
    return True


def test_unpack_early_decision_per_bucket():
    assert run_multiprocess(_check_decisions, 1, backend="gloo", timeout=120) == [True]


class _RecordingComm:
    """Stands in for the NCCL communicator (no GPU here): records what each reduce_bucket call
    hands to NCCL, i.e. the wire it reduces in, its size, split or not, in how many slices."""

    class _Done:
        def wait(self):
            pass

    def __init__(self):
        self.calls = []

    def reduce_bucket(self, grads, flat, scale, pack_stream, split_all_reduce, unpack_stream=0, chunks=1,
                      scratch=None, copy_pack=False):
        assert sum(g.numel() for g in grads) <= flat.numel()
        # NOTE: the scale only where the shard takes it (copy_pack): a packed scale multiplies
        # zeros on a joined rank, whatever it is.
        self.calls.append((flat.data_ptr(), flat.numel(), split_all_reduce, chunks,
                           None if scratch is None else scratch.data_ptr(), copy_pack, scale if copy_pack else None))
        return self._Done()


def _joined_calls_match(rank, ws):
    """A joined rank's reduce_zeros must make the NCCL calls the training ranks' fused calls make,
    bucket by bucket: the same wire (a symmetric window's offset decides NCCL's kernel), the same
    size, split or not, the last bucket in the same slices (tail_chunks), and the same scratch
    (comm_path "copy_engine_a2a": with it NCCL runs an all-to-all, without it a reduce-scatter);
    any difference hangs NCCL or sums the wrong bytes (test_ddp_unpack_gpu.py runs it on 2 GPUs).
    On the split paths with copy_pack every rank scales its reduced shard, so a joined rank passes
    the training ranks' scale too: 1/N, or 1/(ranks still training) for join's
    divide_by_initial_world_size=False (reduce_zeros' divisor; world size 4 stood in here)."""
    ddp = pynccl.DistributedDataParallel(_mlp(), bucket_cap_mb=TINY_BUCKETS_MB)
    x = torch.randn(4, 8)
    for _ in range(2):                             # the second forward rebuilds the buckets
        ddp(x).sum().backward()
    reducer = ddp.reducer
    assert len(reducer.bucketer.buckets) > 2
    scratch = torch.zeros(max(b.extra["wire"].numel() for b in reducer.bucketer.buckets))
    reducer.copy_pack = True                        # opt-in: where the joined rank's scale matters
    split = comm_path.CommPath("copy_engine", split_all_reduce=True)
    cases = [(1, False, comm_path.CommPath("default"), None), (4, False, split, None), (1, True, split, None),
             (1, False, split, 3)]
    for tail_chunks, a2a, path, divisor in cases:
        for b in reducer.bucketer.buckets:          # a stand-in for copy_engine_a2a's shared scratch
            b.extra.pop("scratch", None)
            if a2a:
                b.extra["scratch"] = scratch
        comm = _RecordingComm()
        reducer.fused_comm, reducer.pack_stream, reducer.tail_chunks = comm, type("S", (), {"cuda_stream": 7}), tail_chunks
        reducer.comm_path = path
        reducer.scale = 0.25                        # as at world size 4 (a training rank's set_divisor(None))
        if divisor is not None:
            reducer.set_divisor(divisor)            # join(divide_by_initial_world_size=False), 3 ranks left
        for b in reducer.bucketer.buckets:
            reducer._on_bucket_ready(b)
        reducer.pending = []
        training, comm.calls = comm.calls, []
        reducer.scale = 0.25                        # the joined rank's own: join's exit reset its divisor
        reducer.reduce_zeros(divisor)
        assert comm.calls == training, (tail_chunks, comm.calls, training)
        assert [c[3] for c in training][-1] == tail_chunks
        assert {c[4] for c in training} == ({scratch.data_ptr()} if a2a else {None})
        assert {c[5] for c in training} == {path.split_all_reduce}
        if path.split_all_reduce:
            assert {c[6] for c in training} == {1.0 / (divisor or 4)}
    return True


def test_joined_rank_makes_the_training_ranks_reduce_calls():
    assert run_multiprocess(_joined_calls_match, 1, backend="gloo", timeout=120) == [True]
