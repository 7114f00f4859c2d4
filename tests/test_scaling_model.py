"""The scaling model's formulas (benchmarks/scaling_model.py), by hand, without processes."""
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import scaling_model as sm  # noqa: E402

MiB = 1 << 20
NVLINK = sm.Link(3e-6, 360e9)


def h100_nodes(**kw):
    """8 GPUs per node, 8 × 400 Gb/s NICs."""
    args = dict(gpus_per_node=8, intra=NVLINK, node_net_bytes_s=8 * 400e9 / 8, nics_per_node=8,
                net_latency_s=8e-6, net_efficiency=0.9)
    args.update(kw)
    return sm.Cluster(**args)


def test_collectives_are_alpha_beta_rings():
    link = sm.Link(1e-5, 1e9)
    assert sm.all_gather_s(1, 4e6, link) == 0.0 and sm.all_reduce_s(1, 4e6, link) == 0.0
    assert sm.all_gather_s(4, 4e6, link) == pytest.approx(3 * 1e-5 + 0.75 * 4e6 / 1e9)
    assert sm.reduce_scatter_s(4, 4e6, link) == sm.all_gather_s(4, 4e6, link)
    # all-reduce: ring steps 2(n-1) at n = 4 (6 < tree's 2·2 = 4? no: the tree's 4 wins), tree at 512
    assert sm.all_reduce_s(4, 4e6, link) == pytest.approx(4 * 1e-5 + 1.5 * 4e6 / 1e9)
    assert sm.all_reduce_s(2, 4e6, link) == pytest.approx(2 * 1e-5 + 1.0 * 4e6 / 1e9)
    assert sm.all_reduce_s(512, 0, link) == pytest.approx(18 * 1e-5)


def test_links_inside_and_across_nodes():
    c = h100_nodes()
    assert c.world_link(8) == NVLINK
    # across nodes: the slower of NVLink and the node's network (all NICs, at 90 %), the longer latency
    assert c.world_link(16) == sm.Link(8e-6, min(360e9, 0.9 * 400e9))
    assert c.rail_link() == sm.Link(8e-6, 0.9 * 50e9)                 # one GPU per node: its own NIC
    two_nics = h100_nodes(node_net_bytes_s=2 * 100e9 / 8, nics_per_node=2)
    assert two_nics.rail_link().busbw == pytest.approx(0.9 * 12.5e9 / 4)   # 4 GPUs share each NIC
    assert h100_nodes(rail=sm.Link(1e-3, 1e6)).rail_link() == sm.Link(1e-3, 1e6)


def test_ddp_buckets_and_zero3_collective_counts():
    c = h100_nodes()
    w = sm.Workload(params=25 * MiB, compute_s=1.0, units=4, param_bytes=2, grad_bytes=4)
    grads = 25 * MiB * 4                               # 100 MiB: a 1 MiB first bucket, then 4 of 24.75 MiB
    link = c.world_link(64)
    assert sm.comm_s("ddp", 64, c, w) == {"network": pytest.approx(
        sm.all_reduce_s(64, MiB, link) + 4 * sm.all_reduce_s(64, (grads - MiB) / 4, link))}
    unit = 25 * MiB / 5                                # 4 blocks and the root
    zero3 = 9 * sm.all_gather_s(64, unit * 2, link) + 5 * sm.reduce_scatter_s(64, unit * 4, link)
    assert sm.comm_s("zero3", 64, c, w) == {"network": pytest.approx(zero3)}
    assert sm.comm_s("zero3", 8, c, w) == sm.comm_s("hybrid", 8, c, w)          # one node: the same thing
    assert list(sm.comm_s("ddp", 8, c, w)) == ["nvlink"]
    with pytest.raises(ValueError, match="strategy must be one of"):
        sm.comm_s("fsdp", 8, c, w)


def test_hybrid_shards_in_the_node_and_all_reduces_a_shard_per_rail():
    c = h100_nodes()
    w = sm.Workload(params=25 * MiB, compute_s=1.0, units=4)
    unit = 25 * MiB / 5
    parts = sm.comm_s("hybrid", 64, c, w)
    assert parts["nvlink"] == pytest.approx(9 * sm.all_gather_s(8, unit * 2, NVLINK)
                                            + 5 * sm.reduce_scatter_s(8, unit * 4, NVLINK))
    assert parts["network"] == pytest.approx(5 * sm.all_reduce_s(8, unit * 4 / 8, c.rail_link()))
    # the two parts run on different links, unit after unit: the longer plus one unit of the shorter
    assert sm.total_comm_s("hybrid", 64, c, w) == pytest.approx(max(parts.values()) + min(parts.values()) / 5)


def test_without_latency_hybrid_sends_what_ddp_sends_over_the_network():
    """Bytes across nodes: hybrid all-reduces each gradient once (over the rails), as DDP does over
    the world; only the (m-1)/m against (n-1)/n factor differs."""
    c = h100_nodes(net_latency_s=0.0, intra=sm.Link(0.0, 360e9))
    w = sm.Workload(params=8e9, compute_s=1.0, units=32, bucket_bytes=1 << 40, first_bucket_bytes=1 << 40)
    n, nodes = 512, 64
    ratio = sm.comm_s("hybrid", n, c, w)["network"] / sm.comm_s("ddp", n, c, w)["network"]
    assert ratio == pytest.approx(((nodes - 1) / nodes) / ((n - 1) / n))


def test_step_time_hides_what_fits_under_overlap():
    c = h100_nodes()
    w = sm.Workload(params=1e9, compute_s=0.1, units=16, overlap=0.5)
    comm = sm.total_comm_s("zero3", 64, c, w)
    assert sm.step_s("zero3", 64, c, w) == pytest.approx(0.1 + max(0.0, comm - 0.05))
    assert sm.step_s("zero3", 64, c, sm.Workload(params=1e6, compute_s=10.0, overlap=0.5)) == 10.0


def test_model_state_per_gpu():
    c = h100_nodes()
    w = sm.Workload(params=1e9, compute_s=1.0)
    assert [sm.model_state_bytes(s, 64, c, w) for s in sm.STRATEGIES] == [16e9, 16e9 / 64, 16e9 / 8]


def test_where_hybrid_overtakes_zero3_is_the_first_such_count():
    c = h100_nodes()
    w = sm.Workload(params=1.1e9, compute_s=0.15, units=22)
    for measure in (sm.total_comm_s, sm.step_s):
        where = sm.hybrid_overtakes_zero3(c, w, measure)
        counts = [16 * 2 ** i for i in range(13)]                        # 16 .. 65536
        assert where in counts, where
        assert all(measure("hybrid", n, c, w) < measure("zero3", n, c, w) for n in counts if n >= where)
        assert where == 16 or measure("hybrid", where // 2, c, w) >= measure("zero3", where // 2, c, w)
    # ZeRO-3's rings have n - 1 steps: the step crossover moves to fewer GPUs as latency grows
    slow = h100_nodes(net_latency_s=50e-6)
    assert sm.hybrid_overtakes_zero3(slow, w, sm.step_s) < sm.hybrid_overtakes_zero3(c, w, sm.step_s)
    # Bandwidth alone, on a network-bound cluster: across nodes ZeRO-3 moves 2 gathers + 1 reduce
    # (2·param_bytes + grad_bytes per parameter), hybrid one all-reduce (2·grad_bytes). With fp8
    # gathers and fp32 reduces (6 < 8 bytes) hybrid is shorter only at 2 nodes (an all-reduce over
    # 2 moves half of it), so not "from then on"; with bf16 reduces (6 > 4) from the second node on.
    slow_net = h100_nodes(node_net_bytes_s=10e9, net_latency_s=0.0, intra=sm.Link(0.0, 360e9))
    fp8 = sm.Workload(params=1.1e9, compute_s=0.15, units=22, param_bytes=1, grad_bytes=4)
    assert sm.hybrid_overtakes_zero3(slow_net, fp8) is None
    assert sm.total_comm_s("hybrid", 16, slow_net, fp8) < sm.total_comm_s("zero3", 16, slow_net, fp8)
    bf16 = sm.Workload(params=1.1e9, compute_s=0.15, units=22, param_bytes=2, grad_bytes=2)
    assert sm.hybrid_overtakes_zero3(slow_net, bf16) == 16


def test_command_line(capsys):
    assert sm.main(["--params", "1.1e9", "--compute-ms", "150", "--units", "22", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["gpus"], r["strategy"]) for r in out["rows"]][:3] == [(8, "ddp"), (8, "zero3"), (8, "hybrid")]
    assert out["hybrid_comm_shorter_from"] == 16 and out["hybrid_step_shorter_from"] == 256
    assert math.isclose(out["rows"][0]["model_state_gib"], 16 * 1.1e9 / 2**30)
    assert sm.main([]) == 0
    table = capsys.readouterr().out
    assert "hybrid sharding's step is shorter than ZeRO-3's from" in table and "   512   hybrid" in table
