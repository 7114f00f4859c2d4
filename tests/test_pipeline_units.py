"""Pipeline pieces that need at most a transport: the stage split and stage building (no
processes), the tensor-metadata encoding, and the neighbour-connection exchange every pipeline
rank makes when a schedule is built (gloo, 2 and 3 ranks)."""
import pytest
import torch
from torch import nn

import pynccl
from pynccl.pipeline import build_stage_module, split_into_stages
from pynccl.pipeline.p2p import TensorMeta, decode_meta, encode_meta
from pynccl.testing import run_multiprocess
from numerics import assert_within, chain_rtol


def test_split_balanced_by_parameters():
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 40), nn.ReLU(), nn.Linear(40, 4)]
    # params: 20, 0, 20, 200, 0, 164 -> the heaviest stage is as light as it can be (200), and
    # holds as few layers as it can (the ReLU goes to the lighter stage after it).
    assert split_into_stages(layers, 3) == [(0, 3), (3, 4), (4, 6)]
    assert split_into_stages(nn.Sequential(*layers), 1) == [(0, 6)]
    assert split_into_stages(layers, 6) == [(i, i + 1) for i in range(6)]
    # Parameter-free layers alone: ties broken by layer count.
    assert split_into_stages([nn.ReLU() for _ in range(6)], 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_into_stages(layers, 3, boundaries=[1, 4]) == [(0, 1), (1, 4), (4, 6)]


def test_split_errors():
    layers = [nn.Linear(2, 2) for _ in range(4)]
    with pytest.raises(ValueError, match="cannot cut 4 layers into 5"):
        split_into_stages(layers, 5)
    with pytest.raises(ValueError, match="num_stages - 1 = 1"):
        split_into_stages(layers, 2, boundaries=[1, 2])
    with pytest.raises(ValueError, match="strictly increasing"):
        split_into_stages(layers, 3, boundaries=[2, 2])
    with pytest.raises(ValueError, match="strictly increasing"):
        split_into_stages(layers, 2, boundaries=[4])
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        split_into_stages(nn.Linear(2, 2), 1)
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        split_into_stages([nn.Linear(2, 2), 3], 1)
    with pytest.raises(ValueError, match="stage_index must be in"):
        build_stage_module(layers, 2, 2)


def test_build_stage_module_builds_only_its_stage():
    built = []

    def factory(n_in, n_out):
        def make():
            layer = nn.Linear(n_in, n_out)
            built.append((n_in, n_out, layer.weight.device.type))
            return layer
        return make

    layers = [factory(4, 4), factory(4, 100), factory(100, 4), factory(4, 4)]
    assert split_into_stages(layers, 2) == [(0, 2), (2, 4)]   # counted on the meta device
    assert {d for *_, d in built} == {"meta"}
    built.clear()
    stage = build_stage_module(layers, 1, 2)
    assert [b for b in built if b[2] != "meta"] == [(100, 4, "cpu"), (4, 4, "cpu")]
    assert [tuple(m.weight.shape) for m in stage] == [(4, 100), (4, 4)]
    assert all(p.device.type == "cpu" for p in stage.parameters())
    seq = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    mod = build_stage_module(seq, 0, 2, boundaries=[1])
    assert len(mod) == 1 and mod[0] is seq[0]


def test_metadata_round_trip():
    metas = [TensorMeta((4, 8), torch.float32), TensorMeta((4,), torch.int64), TensorMeta((), torch.bfloat16),
             TensorMeta((2, 3, 5), torch.float64)]
    assert decode_meta(encode_meta(metas)) == metas
    with pytest.raises(TypeError, match="cannot send a tensor of dtype"):
        encode_meta([TensorMeta((1,), torch.quint8)])



def _connect_case(rank, ws):
    from pynccl.pipeline.p2p import PipeTransport
    t = PipeTransport(pynccl.get_default_group(), torch.device("cpu"))   # CPU: not connected at construction
    t._connect_neighbours(nbytes=64)             # the exchange NCCL transports make when built
    # Then a GPipe-shaped first batch: send to the next rank and receive from it, both at once.
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    out = torch.full((3,), float(rank))
    got_prev, got_next = torch.empty(3), torch.empty(3)
    t.start([(out, nxt), (out, prv)], [(got_prev, prv), (got_next, nxt)]).wait()
    return got_prev.tolist(), got_next.tolist()


@pytest.mark.parametrize("ws", [2, 3])
def test_neighbour_connection_exchange_is_matched(ws):
    """The connect-at-construction exchange pairs every send with a receive (else it would hang
    here on gloo as it would on NCCL) and leaves the channels in order for the next batch."""
    out = run_multiprocess(_connect_case, ws, timeout=60)
    for r, (prev, nxt) in enumerate(out):
        assert prev == [float((r - 1) % ws)] * 3 and nxt == [float((r + 1) % ws)] * 3


def _cuda_graph_refusals(rank, world_size):
    from pynccl.pipeline import PipelineStage
    mod = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device, but the stage computes on cpu"):
        PipelineStage(mod, 0, 1, cuda_graph=True)
    with pytest.raises(TypeError, match="cuda_graph must be a bool, got int"):
        PipelineStage(mod, 0, 1, cuda_graph=1)
    assert PipelineStage(mod, 0, 1).graphs is None
    # A ZeRO or DDP wrapper anywhere inside the stage (examples/train_llama.py pipelines a ZeRO-3 model
    # inside a plain module) communicates and frees parameters in forward: refused, named.
    zero = pynccl.FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), stage=3)
    with pytest.raises(TypeError, match=r"but inner is a data-parallel wrapper"):
        PipelineStage(nn.ModuleDict({"inner": zero}), 0, 1, cuda_graph=True)
    ddp = pynccl.DistributedDataParallel(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"but the stage module is a data-parallel wrapper"):
        PipelineStage(ddp, 0, 1, cuda_graph=True)
    return True


def test_cuda_graph_stage_refuses_what_it_cannot_capture():
    """CUDA-graphed stages (pipeline/graphs.py; replays are tested on GPUs in
    test_pipeline_graphs_gpu.py) are refused on a CPU stage and around data-parallel wrappers, with
    a message naming the device or the wrapper."""
    assert run_multiprocess(_cuda_graph_refusals, 1, timeout=60) == [True]


def test_cuda_graph_signature_sees_what_a_capture_fixes():
    """Everything a captured graph bakes in is in its signature, so a change raises instead of
    replaying stale graphs: input shape, dtype, requires_grad and device, non-tensor arguments, grad
    mode, a submodule's train/eval mode, a parameter's storage or requires_grad, a buffer's storage."""
    from pynccl.pipeline.graphs import _signature, check_signature
    mod = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(2, 4, requires_grad=True)
    base = _signature([x, 3], mod)
    check_signature(base, _signature([torch.randn(2, 4).requires_grad_(), 3], mod), 0)   # same: passes
    for args, match in (([torch.randn(3, 4, requires_grad=True), 3], r"micro-batch 5 has inputs \[\(3, 4\) float32"),
                        ([x.double(), 3], "float64"), ([x.detach(), 3], r"inputs \[\(2, 4\) float32 on cpu, 3\]"),
                        ([x, 4], r"float32 requires_grad on cpu, 4\]")):
        with pytest.raises(ValueError, match=match):
            check_signature(base, _signature(args, mod), 5)
    with torch.no_grad():
        with pytest.raises(ValueError, match="grad mode off, but the stage's graphs were captured for .* grad mode on"):
            check_signature(base, _signature([x, 3], mod), 0)
    changes = [
        (lambda: mod[1].eval(), lambda: mod[1].train(), "a submodule's training/eval mode changed"),
        (lambda: mod[0].weight.requires_grad_(False), lambda: mod[0].weight.requires_grad_(True),
         "a parameter's storage or requires_grad changed"),
        (lambda: setattr(mod[0].weight, "data", mod[0].weight.data.clone()), None,
         "a parameter's storage or requires_grad changed"),
        (lambda: setattr(mod[1], "running_mean", mod[1].running_mean.clone()), None, "a buffer's storage changed"),
    ]
    for change, undo, match in changes:
        base = _signature([x, 3], mod)
        change()
        with pytest.raises(RuntimeError, match=match):
            check_signature(base, _signature([x, 3], mod), 0)
        if undo is not None:
            undo()
            check_signature(base, _signature([x, 3], mod), 0)


class _StandInGraph:
    """What a captured graph does on replay, as a Python function over the slot's static tensors."""

    def __init__(self, fn):
        self.replay = fn


def test_cuda_graph_replay_node_routes_gradients_like_autograd():
    """The replay's autograd node (graphs._Replay) on CPU, with stand-in graphs computing y = x @ w
    into the slot's static buffers: two micro-batches through one slot give the eager gradients of
    x and w (w's accumulated over both), .grad never aliases the slot's buffers, a
    non-differentiable output comes back as a copy, and each micro-batch's inputs are copied in."""
    from pynccl.pipeline.graphs import _Replay, _Slot
    w = nn.Parameter(torch.randn(3, 2))
    slot = object.__new__(_Slot)
    slot.tensor_idx, slot.static_args = [0], [torch.zeros(4, 3, requires_grad=True)]
    slot.static_outs = [torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)]
    slot.differentiable = [True, False]
    slot.static_grad_outs = [torch.zeros(4, 2)]
    slot.static_input_grads, slot.static_param_grads = [torch.zeros(4, 3)], [torch.zeros(3, 2)]
    slot.grad_input_mask = [True]

    def fwd():
        x = slot.static_args[0].detach()
        slot.static_outs[0].copy_(x @ w.detach())
        slot.static_outs[1].copy_(x.argmax(1))

    def bwd():
        g, x = slot.static_grad_outs[0], slot.static_args[0].detach()
        slot.static_input_grads[0].copy_(g @ w.detach().t())
        slot.static_param_grads[0].copy_(x.t() @ g)
    slot.fwd, slot.bwd = _StandInGraph(fwd), _StandInGraph(bwd)

    ref_w = w.detach().clone().requires_grad_(True)
    for mb in range(2):
        x = torch.randn(4, 3, requires_grad=True)
        c = torch.randn(4, 2)
        y, idx = _Replay.apply(slot, x, w)
        assert not idx.requires_grad and idx.data_ptr() != slot.static_outs[1].data_ptr()
        assert torch.equal(idx, x.detach().argmax(1))
        (y * c).sum().backward()
        xr = x.detach().clone().requires_grad_(True)
        (xr @ ref_w * c).sum().backward()
        # The same products as autograd's, perhaps transposed differently: dot products of 2 and 4
        # terms, summed in another order (tests/numerics.py): 4·eps of the largest value.
        for got, expected in ((x.grad, xr.grad), (w.grad, ref_w.grad)):
            assert_within(got, expected, chain_rtol(4) * expected.abs().max().item(), f"micro-batch {mb}")
        assert x.grad.data_ptr() != slot.static_input_grads[0].data_ptr()
        assert w.grad.data_ptr() != slot.static_param_grads[0].data_ptr()
