"""ZeRO's pure index arithmetic, no processes: the row-aligned flat layout (every rank's piece of
every parameter is whole rows) and the choice of stage-3 units."""
import pytest
import torch
from torch import nn

from pynccl.zero import FlatLayout
from pynccl.zero.wrap import select_unit_modules
from test_zero import D, Block, Net


def test_flat_layout_uneven_shards():
    lay = FlatLayout(["a", "b", "c"], [torch.Size([2, 3]), torch.Size([5]), torch.Size([])], [0, 1, 2], world_size=4)
    assert (lay.numel, lay.padded_numel, lay.shard_numel, lay.split_sizes) == (12, 12, 3, [0, 6, 0, 5, 0, 1, 0])
    # (2, 3) would be cut inside its second row at element 4: one element of padding moves it
    # so the boundary falls between its rows.
    lay = FlatLayout(["a", "b"], [torch.Size([2, 3]), torch.Size([5])], [0, 1], world_size=3)
    assert (lay.padded_numel, lay.shard_numel, lay.split_sizes) == (12, 4, [1, 6, 0, 5, 0])
    assert lay.shard_pieces(0) == [(0, 0, 1, 3)]
    assert lay.shard_pieces(1) == [(0, 3, 0, 3), (1, 0, 3, 1)]
    assert lay.shard_pieces(2) == [(1, 1, 0, 4)]
    a, b = torch.arange(6.).view(2, 3), torch.arange(10., 15.)
    shards = []
    for r in range(3):
        out = torch.full((4,), -1.)
        lay.shard_from_params(r, [a, b], out)
        shards.append(out)
        assert [tuple(v.shape) for v in lay.local_views(r, out)] == [[(1, 3), (0,)], [(1, 3), (1,)], [(0, 3), (4,)]][r]
        assert [lay.local_part(r, i, t).tolist() for i, t in enumerate((a, b))] == \
            [v.tolist() for v in lay.local_views(r, out)]
    assert torch.cat(shards).tolist() == [0.] + list(range(6)) + list(range(10, 15))
    # A parameter spanning two boundaries makes the shard a whole number of its rows.
    lay = FlatLayout(["w"], [torch.Size([9, 5])], [0], world_size=4)
    assert (lay.shard_numel, [tuple(v.shape) for v in lay.local_views(1, torch.zeros(lay.shard_numel))]) == \
        (15, [(3, 5)])
    # Every rank's piece of every parameter is whole rows, for shapes nobody chose to be nice.
    shapes = [torch.Size(s) for s in [(7, 3), (13,), (5, 2, 3), (), (11, 4), (3, 7)]]
    for ws in (1, 2, 3, 4, 5, 8):
        lay = FlatLayout([str(i) for i in range(len(shapes))], shapes, list(range(len(shapes))), world_size=ws)
        assert lay.padded_numel < 2 * lay.numel + 8 * ws, (ws, lay)
        for r in range(ws):
            for p in lay.shard_pieces(r):
                row = lay.slots[p.slot_idx].row_numel
                assert p.param_start % row == 0 and p.numel % row == 0, (ws, r, p)
        assert sum(p.numel for r in range(ws) for p in lay.shard_pieces(r)) == lay.numel
    assert FlatLayout(["x"], [torch.Size([1])], [0], world_size=4).padded_numel == 4    # >= 1 element per rank
    assert FlatLayout.from_metadata(lay.metadata()) == lay
    with pytest.raises(ValueError, match="multiple of world_size"):
        FlatLayout(["a"], [torch.Size([5])], [0], world_size=2, padded_numel=5)


def test_wrap_selection():
    net = Net()
    assert select_unit_modules(net, None) == list(net.blocks)
    assert select_unit_modules(net, [nn.LayerNorm]) == [b.ln for b in net.blocks] + [net.norm]
    assert select_unit_modules(net, [Block, nn.Linear]) == list(net.blocks) + [net.head]   # outermost only
    assert select_unit_modules(net, lambda m: m is net.norm) == [net.norm]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert select_unit_modules(seq, "auto") == [seq[0], seq[2]]
    # auto, with layers: an untied module outside them holding >= 1/4 of a layer's parameters is a
    # unit too, in module order; a tied one (net.emb / net.head), a small one and a holder of layers are not.
    untied = Net()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    untied.norm2 = nn.LayerNorm(D)                     # 2·D, under a quarter of a block
    untied.holder = nn.Module()
    untied.holder.w = nn.Parameter(torch.zeros(1000))  # holds layers below: never a unit
    untied.holder.layers = nn.ModuleList([Block()])
    picked = select_unit_modules(untied, None)
    assert picked == [untied.emb] + list(untied.blocks) + [untied.head] + list(untied.holder.layers), picked
    with pytest.raises(TypeError, match="wrap_modules"):
        select_unit_modules(net, 3)
    with pytest.raises(TypeError, match="wrap_modules entries"):
        select_unit_modules(net, ["blocks"])


def _dropped_models_free_their_shards(rank, ws):
    import gc
    import weakref
    import pynccl
    from test_zero import global_batch, local
    alive = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = pynccl.FullyShardedDataParallel(Net(), stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(*local(global_batch(0), rank, ws)).backward()
        opt.step()
        refs = [weakref.ref(u.shard) for u in model.units] + [weakref.ref(model)]
        del model, opt
        gc.collect()
        alive[stage] = sum(r() is not None for r in refs)
    return alive


def test_dropped_models_free_their_shards():
    """A dropped model takes its shards with it (stage 3's gradient hooks once held the runtime
    from C++, out of the garbage collector's sight)."""
    from pynccl.testing import run_multiprocess
    assert run_multiprocess(_dropped_models_free_their_shards, 2) == [{1: 0, 2: 0, 3: 0}] * 2
