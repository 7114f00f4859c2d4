"""The row plans behind sharded checkpoints, without processes: chunk_rows is torch.chunk's (and
DTensor Shard(0)'s) split, flat_rows is what ZeRO's flat layout gives each rank, and the send /
receive pieces that exchange_rows derives on every rank move each wanted row exactly once, from
whoever holds it (simulated here for all ranks at once, for ZeRO's layouts and TP's fused one).
"""
import pytest
import torch

from pynccl.tensor_parallel.dcp import _fused_rows
from pynccl.zero.layout import FlatLayout
from pynccl.zero.row_exchange import _pieces, chunk_rows, flat_rows
from pynccl.zero.sharded_state import _even_rows
from test_zero import Net


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 11, 64])
@pytest.mark.parametrize("ws", [1, 2, 3, 4, 8])
def test_chunk_rows_is_torch_chunk(rows, ws):
    t = torch.arange(rows)
    chunks = list(t.chunk(ws)) if rows else []
    got = [chunk_rows(rows, ws, r) for r in range(ws)]
    assert [list(t[g.start:g.stop]) for g in got] == [list(c) for c in chunks] + [[]] * (ws - len(chunks))


def _layout(ws):
    net = Net()
    params = list(net.named_parameters())
    return FlatLayout([n for n, _ in params], [p.shape for _, p in params], list(range(len(params))), ws)


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 7])
def test_flat_rows_match_the_layouts_local_views(ws):
    layout = _layout(ws)
    for r in range(ws):
        shard = torch.arange(r * layout.shard_numel, (r + 1) * layout.shard_numel, dtype=torch.float64)
        for slot, rows, view in zip(layout.slots, flat_rows(layout, r), layout.local_views(r, shard)):
            if len(slot.shape):
                assert view.shape[0] == len(rows), (slot.name, r)
            full = torch.arange(slot.numel, dtype=torch.float64).view(slot.shape) + slot.offset
            # the view holds rows `rows` of the parameter (flat buffer offsets = values here)
            assert torch.equal(view.reshape(-1), full.reshape(-1)[rows.start * slot.row_numel: rows.stop *
                                                                    slot.row_numel]), (slot.name, r)


def _simulate(src, dst):
    """Every rank's pieces, applied: {rank: rows it ends with} from src's holdings, counting receipts."""
    ws = len(src)
    got = {}
    for me in range(ws):
        out = [None] * sum(len(d) for d in dst[me])
        for peer in range(ws):
            held = [row for rg in src[peer] for row in rg]        # peer's rows in its local order
            for src_off, dst_off, n in _pieces(src[peer], dst[me]):
                for k in range(n):
                    assert out[dst_off + k] is None, "a row received twice"
                    out[dst_off + k] = held[src_off + k]
        got[me] = out
    return got


@pytest.mark.parametrize("ws", [1, 2, 3, 5])
def test_pieces_move_every_row_once_both_ways(ws):
    layout = _layout(ws)
    held = [flat_rows(layout, r) for r in range(ws)]
    for i, slot in enumerate(layout.slots):
        flat = [[held[r][i]] for r in range(ws)]
        even = _even_rows(slot.shape, ws)
        wanted = {me: [row for rg in even[me] for row in rg] for me in range(ws)}
        assert _simulate(flat, even) == wanted, slot.name
        back = {me: [row for rg in flat[me] for row in rg] for me in range(ws)}
        assert _simulate(even, flat) == back, slot.name


@pytest.mark.parametrize("tp,num_chunks,rows", [(2, 3, 12), (3, 3, 18), (4, 2, 16)])
def test_fused_rows_regroup(tp, num_chunks, rows):
    fused = _fused_rows(rows, num_chunks, tp)
    # rank r's fused slice is [q_r | k_r | v_r]: the shard_tensor slicing of each block
    full = torch.arange(rows)
    for r in range(tp):
        mine = torch.cat([b.chunk(tp)[r] for b in full.chunk(num_chunks)])
        assert [row for rg in fused[r] for row in rg] == mine.tolist()
    even = [[chunk_rows(rows, tp, r)] for r in range(tp)]
    assert _simulate(fused, even) == {r: list(even[r][0]) for r in range(tp)}
