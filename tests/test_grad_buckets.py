"""Bucket assignment and the gradient-ready machinery, in one process (no communication):
caps, dtype separation, in-order hand-out, end-of-backward callback, errors."""
import pytest
import torch
import torch.nn as nn

from pynccl.comm.coalesced import MiB, assign_buckets
from pynccl.ddp.buckets import GradBucketer


def _meta(numel, dtype=torch.float32):
    return torch.empty(numel, dtype=dtype, device="meta")


def test_first_bucket_small_then_cap():
    # 4-byte floats: 1 MiB = 262144 elements.
    ts = [_meta(200_000), _meta(100_000), _meta(100_000), _meta(1_000_000), _meta(10)]
    # First bucket closes once >= 1 MiB (after the 2nd tensor); then a 4 MiB cap.
    assert assign_buckets(ts, first_cap_bytes=1 * MiB, cap_bytes=4 * MiB) == [[0, 1], [2, 3], [4]]


def test_oversized_tensor_alone_not_after_small_ones():
    # A tensor of >= cap bytes (a tied embedding) closes the open bucket instead of joining it,
    # also while the small first bucket is open.
    ts = [_meta(100), _meta(2_000_000), _meta(100), _meta(100), _meta(3_000_000), _meta(100)]
    assert assign_buckets(ts, first_cap_bytes=1 * MiB, cap_bytes=4 * MiB) == [[0], [1], [2, 3], [4], [5]]
    # Below cap_bytes (but above the first cap) it still joins the first bucket, as in torch.
    assert assign_buckets(ts[:2], first_cap_bytes=1 * MiB, cap_bytes=16 * MiB) == [[0, 1]]


def test_large_tensor_gets_own_bucket_and_caps_validated():
    ts = [_meta(10), _meta(10_000_000), _meta(10)]
    assert assign_buckets(ts, first_cap_bytes=8, cap_bytes=1 * MiB) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="caps must be positive"):
        assign_buckets(ts, first_cap_bytes=0, cap_bytes=1)


def test_one_dtype_per_bucket_sorted_by_readiness():
    ts = [_meta(100, torch.float32), _meta(100, torch.bfloat16), _meta(100, torch.float32),
          _meta(100, torch.bfloat16), _meta(100, torch.float32)]
    buckets = assign_buckets(ts, first_cap_bytes=MiB, cap_bytes=MiB)
    assert sorted(buckets) == [[0, 2, 4], [1, 3]]
    assert buckets == [[1, 3], [0, 2, 4]]       # the bf16 bucket's last member comes first
    for b in buckets:
        assert len({ts[i].dtype for i in b}) == 1


def test_every_tensor_exactly_once():
    sizes = [7, 300_000, 1, 50_000, 900_000, 3, 262_144, 12]
    ts = [_meta(n, torch.float16 if i % 3 == 0 else torch.float32) for i, n in enumerate(sizes)]
    buckets = assign_buckets(ts, first_cap_bytes=MiB, cap_bytes=2 * MiB)
    assert sorted(i for b in buckets for i in b) == list(range(len(ts)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.b.weight = self.a.weight             # tied

    def forward(self, x):
        return self.c(self.b(self.a(x)).relu())


def _tiny_bucketer(net, events, **kw):
    names = {p: n for n, p in net.named_parameters()}
    return GradBucketer(net.parameters(), lambda b: events.append(("bucket", b.index, [names[p] for p in b.params])),
                        lambda: events.append(("end",)), param_names=names, **kw)


def test_bucketer_params_order_and_padding():
    net = _Net()
    bk = _tiny_bucketer(net, [], bucket_cap_bytes=40, first_bucket_cap_bytes=8, pad_to=3)
    # requires_grad=False dropped, the tied weight kept once: a.w, a.b, b.b, c.w, c.b.
    assert len(bk.params) == 5
    assert [bk.param_names[i] for i in bk.buckets[0].param_indices] == ["c.bias"]
    for b in bk.buckets:
        assert b.numel % 3 == 0 and b.numel >= b.num_grad_elements and b.buffer.numel() == b.numel
        for v, p in zip(b.views(), b.params):
            assert v.shape == p.shape and v.data_ptr() >= b.buffer.data_ptr()


def test_bucketer_real_backward_in_order_then_end_and_ready_order():
    torch.manual_seed(0)
    net = _Net()
    events = []
    bk = _tiny_bucketer(net, events, bucket_cap_bytes=1, first_bucket_cap_bytes=1)  # one param per bucket
    bk.register_hooks()
    bk.prepare_for_backward()
    net(torch.randn(3, 4)).sum().backward()
    assert events[-1] == ("end",)
    handed = [e[1] for e in events if e[0] == "bucket"]
    assert handed == list(range(len(bk.buckets)))       # strictly in bucket order
    assert not bk.armed and sorted(bk.ready_order) == list(range(5))
    # Not armed: a second backward hands nothing out (no_sync semantics).
    events.clear()
    bk.disarm()
    net(torch.randn(3, 4)).sum().backward()
    assert events == []
    # Rebuild in the observed order: buckets now follow readiness.
    bk.rebuild(bk.ready_order)
    assert [b.param_indices[0] for b in bk.buckets] == bk.ready_order
    bk.remove_hooks()


def test_bucketer_out_of_order_arrival_waits_for_earlier_bucket():
    ps = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    events = []
    bk = GradBucketer(ps, lambda b: events.append(b.index), lambda: events.append("end"),
                      bucket_cap_bytes=1, first_bucket_cap_bytes=1)
    # Buckets are in reverse registration order: bucket 0 = ps[2].
    bk.prepare_for_backward()
    bk.mark_ready(ps[0])                                 # bucket 2: must wait for 0 and 1
    assert events == []
    bk.mark_ready(ps[2])
    assert events == [0]
    bk.mark_ready(ps[1])                                 # releases 1, then 2, then end (no backward: at once)
    assert events == [0, 1, 2, "end"]
    assert bk.ready_order == [0, 2, 1]


def test_bucketer_unused_and_errors():
    ps = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    names = {p: f"p{i}" for i, p in enumerate(ps)}
    events = []
    bk = GradBucketer(ps, lambda b: events.append(b.index), param_names=names,
                      bucket_cap_bytes=1, first_bucket_cap_bytes=1)
    # Unused parameters count as ready at the first hook.
    bk.prepare_for_backward(unused=[ps[1]])
    bk.mark_ready(ps[2])
    bk.mark_ready(ps[0])
    assert events == [0, 1, 2] and not bk.armed
    # A parameter that never gets a gradient: the next prepare names it.
    bk.prepare_for_backward()
    bk.mark_ready(ps[2])
    with pytest.raises(RuntimeError, match=r"did not receive grad: p0, p1"):
        bk.prepare_for_backward()
    bk.prepare_for_backward()                            # the error reset the state
    bk.mark_ready(ps[0])
    with pytest.raises(RuntimeError, match="'p0' ready only once"):
        bk.mark_ready(ps[0])
    with pytest.raises(ValueError, match="not one of this bucketer's parameters"):
        bk.mark_ready(nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match="permutation"):
        bk.rebuild([0, 0, 1])
    with pytest.raises(ValueError, match="no parameter requires a gradient"):
        GradBucketer([torch.zeros(2)], lambda b: None)


def test_dropped_bucketer_frees_buffers_and_hooks():
    import gc
    import weakref
    p = nn.Parameter(torch.zeros(4))
    bk = GradBucketer([p], lambda b: None)
    bk.register_hooks()
    assert len(p._post_accumulate_grad_hooks) == 1
    buf = weakref.ref(bk.buckets[0].buffer)
    del bk
    gc.collect()
    assert buf() is None and not p._post_accumulate_grad_hooks
    (p * 2).sum().backward()             # no hook left to fire
