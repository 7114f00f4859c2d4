"""Scaling on paper: DDP, ZeRO-3 and hybrid sharding step times at 8, 64, 512 GPUs, predicted
from single-node figures (compute time per step, NVLink bus bandwidth and latency) and the
network's (bandwidth per node, latency), as docs/scaling.md explains. Weak scaling: the batch per
GPU is fixed, so compute per step is too and only communication changes with the GPU count.

    python benchmarks/scaling_model.py --params 8e9 --compute-ms 1000 --units 32
    python benchmarks/scaling_model.py --json          # the table as JSON

Every collective costs latency × steps + bytes-factor × bytes / bus bandwidth (the α-β model
behind nccl-tests' busbw): a ring all-gather or reduce-scatter over n ranks takes n - 1 steps and
moves (n-1)/n of the gathered size; an all-reduce takes the better of a ring (2(n-1) steps) and
NCCL's tree (2·log2 n steps), moving 2(n-1)/n of its size either way. A group inside a node uses
the NVLink figures; a world group spanning nodes the slower of NVLink and the network, whose bus
bandwidth is the whole node's (NCCL runs one ring per NIC, so every NIC carries 1/nics of the
traffic; 8 × 400 Gb/s reaches ≈ 0.9 × 400 GB/s); a hybrid replicate group (one GPU per node) has
one NIC. Hybrid's NVLink and network parts run on different links and communicators, unit after
unit, so they overlap each other: max of the two plus one unit's worth of the other. Communication
hides under `overlap` × compute, the rest adds to the step.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

MiB = 1 << 20
STRATEGIES = ("ddp", "zero3", "hybrid")


@dataclass(frozen=True)
class Link:
    """What a collective pays on one kind of group: per ring step, and per byte."""
    latency_s: float
    busbw: float                       # bytes per second, as nccl-tests' busbw


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    intra: Link                        # one node (NVLink), measured with pynccl-bench on one node
    node_net_bytes_s: float            # the network per node, all NICs together (8 × 400 Gb/s = 400e9 B/s)
    nics_per_node: int
    net_latency_s: float               # per ring step between nodes
    net_efficiency: float = 0.9        # the busbw NCCL reaches, as a fraction of the link rate
    rail: Optional[Link] = None        # measured one-GPU-per-node groups, else derived from the NICs

    def world_link(self, n: int) -> Link:
        """A group of n consecutive ranks: one node's NVLink, or NVLink and the network together."""
        if n <= self.gpus_per_node:
            return self.intra
        return Link(max(self.intra.latency_s, self.net_latency_s),
                    min(self.intra.busbw, self.net_efficiency * self.node_net_bytes_s))

    def rail_link(self) -> Link:
        """A group of one GPU per node (hybrid's replicas): the GPU's own NIC (its share of one)."""
        if self.rail is not None:
            return self.rail
        per_gpu = self.node_net_bytes_s / self.nics_per_node * min(1.0, self.nics_per_node / self.gpus_per_node)
        return Link(self.net_latency_s, self.net_efficiency * per_gpu)


@dataclass(frozen=True)
class Workload:
    params: float                      # Ψ, number of parameters
    compute_s: float                   # forward + backward + optimizer, per GPU and step, no communication
    units: int = 32                    # ZeRO-3 units (transformer blocks); the root unit comes on top
    param_bytes: int = 2               # the gathered (compute) dtype
    grad_bytes: int = 4                # the reduce dtype (FSDP MixedPrecision(bf16, reduce fp32))
    bucket_bytes: int = 25 * MiB       # DDP's bucket_cap_mb
    first_bucket_bytes: int = 1 * MiB  # DDP's first bucket (torch's and pynccl's default)
    overlap: float = 0.8               # the part of compute that communication can hide under


# ---------------------------------------------------------------------- collectives
def all_gather_s(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather of `nbytes` (the gathered size) over n ranks."""
    return 0.0 if n <= 1 else (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.busbw


reduce_scatter_s = all_gather_s       # the same ring, the other direction


def all_reduce_s(n: int, nbytes: float, link: Link) -> float:
    """All-reduce of `nbytes`: NCCL's ring or tree, whichever is faster (same bandwidth term)."""
    if n <= 1:
        return 0.0
    steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
    return steps * link.latency_s + 2 * (n - 1) / n * nbytes / link.busbw


# ---------------------------------------------------------------------- strategies
def comm_s(strategy: str, n: int, cluster: Cluster, w: Workload) -> Dict[str, float]:
    """Seconds of communication per step and GPU, by where it runs ("nvlink", "network")."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    g = cluster.gpus_per_node
    link = cluster.world_link(n)
    where = "nvlink" if n <= g else "network"
    unit_params = w.params / (w.units + 1)             # the blocks and the root, about equal
    if strategy == "ddp":
        grads = w.params * w.grad_bytes
        first = min(grads, w.first_bucket_bytes)
        rest = grads - first
        buckets = math.ceil(rest / w.bucket_bytes)
        return {where: all_reduce_s(n, first, link) + (buckets * all_reduce_s(n, rest / buckets, link) if rest else 0.0)}
    gathers, reduces = 2 * w.units + 1, w.units + 1   # forward and backward per block, the root once
    if strategy == "zero3" or n <= g:
        return {where: gathers * all_gather_s(n, unit_params * w.param_bytes, link)
                + reduces * reduce_scatter_s(n, unit_params * w.grad_bytes, link)}
    # hybrid: shard within a node, replicate across nodes
    nodes = n // g
    inside = (gathers * all_gather_s(g, unit_params * w.param_bytes, cluster.intra)
              + reduces * reduce_scatter_s(g, unit_params * w.grad_bytes, cluster.intra))
    across = reduces * all_reduce_s(nodes, unit_params * w.grad_bytes / g, cluster.rail_link())
    return {"nvlink": inside, "network": across}


def total_comm_s(strategy: str, n: int, cluster: Cluster, w: Workload) -> float:
    """The communication's time per step: hybrid's two parts pipelined unit by unit (the longer,
    plus one unit of the shorter), anything else one part."""
    parts = list(comm_s(strategy, n, cluster, w).values())
    if len(parts) == 1:
        return parts[0]
    return max(parts) + min(parts) / (w.units + 1)


def step_s(strategy: str, n: int, cluster: Cluster, w: Workload) -> float:
    """Compute, plus the communication that does not fit under overlap × compute."""
    return w.compute_s + max(0.0, total_comm_s(strategy, n, cluster, w) - w.overlap * w.compute_s)


def model_state_bytes(strategy: str, n: int, cluster: Cluster, w: Workload) -> float:
    """Per GPU, mixed-precision Adam (ZeRO paper's 16 bytes per parameter: bf16 params and grads,
    fp32 master, momentum, variance), without activations or gathered units."""
    shards = {"ddp": 1, "zero3": n, "hybrid": min(n, cluster.gpus_per_node)}[strategy]
    return 16 * w.params / shards


def predict(cluster: Cluster, w: Workload, gpu_counts: Sequence[int] = (8, 64, 512)) -> List[dict]:
    rows = []
    for n in gpu_counts:
        for s in STRATEGIES:
            parts = comm_s(s, n, cluster, w)
            rows.append({"gpus": n, "strategy": s, "step_ms": 1e3 * step_s(s, n, cluster, w),
                         "comm_ms": 1e3 * total_comm_s(s, n, cluster, w),
                         "comm_parts_ms": {k: 1e3 * v for k, v in parts.items()},
                         "model_state_gib": model_state_bytes(s, n, cluster, w) / 2**30})
    return rows


def hybrid_overtakes_zero3(cluster: Cluster, w: Workload, measure=None, max_gpus: int = 1 << 16) -> Optional[int]:
    """The GPU count (whole nodes, doubling up to max_gpus) from which on hybrid's communication
    (or, with measure=step_s, its step) stays shorter than ZeRO-3's, or None if it never does."""
    measure = measure or total_comm_s
    counts, n = [], 2 * cluster.gpus_per_node
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    since = None
    for n in counts:
        if measure("hybrid", n, cluster, w) < measure("zero3", n, cluster, w):
            since = since or n
        else:
            since = None
    return since


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=8e9, help="parameters (8e9)")
    p.add_argument("--compute-ms", type=float, default=1000.0,
                   help="compute per step and GPU, no communication, measured on one GPU (1000)")
    p.add_argument("--units", type=int, default=32, help="ZeRO-3 units, i.e. transformer blocks (32)")
    p.add_argument("--param-bytes", type=int, default=2, help="bytes per gathered parameter (2: bf16)")
    p.add_argument("--grad-bytes", type=int, default=4, help="bytes per reduced gradient (4: fp32)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (25)")
    p.add_argument("--overlap", type=float, default=0.8, help="fraction of compute that hides communication (0.8)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-busbw", type=float, default=360.0,
                   help="GB/s, all-reduce busbw on one node (pynccl-bench; 8×H100 ≈ 360)")
    p.add_argument("--nvlink-latency-us", type=float, default=3.0, help="per ring step inside a node (3)")
    p.add_argument("--nics-per-node", type=int, default=8)
    p.add_argument("--nic-gbps", type=float, default=400.0, help="Gb/s per NIC (400)")
    p.add_argument("--net-latency-us", type=float, default=8.0, help="per ring step between nodes (8)")
    p.add_argument("--net-efficiency", type=float, default=0.9, help="busbw reached / link rate (0.9)")
    p.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 512])
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def from_args(a) -> tuple:
    cluster = Cluster(a.gpus_per_node, Link(a.nvlink_latency_us * 1e-6, a.nvlink_busbw * 1e9),
                      a.nics_per_node * a.nic_gbps * 1e9 / 8, a.nics_per_node, a.net_latency_us * 1e-6,
                      a.net_efficiency)
    work = Workload(a.params, a.compute_ms / 1e3, units=a.units, param_bytes=a.param_bytes,
                    grad_bytes=a.grad_bytes, bucket_bytes=int(a.bucket_mb * MiB), overlap=a.overlap)
    return cluster, work


def format_table(rows: List[dict], cluster: Cluster, w: Workload) -> str:
    lines = [f"# {w.params / 1e9:g}B parameters, {1e3 * w.compute_s:g} ms compute per step and GPU, "
             f"{w.units} units, overlap {w.overlap}; {cluster.gpus_per_node} GPUs per node, NVLink "
             f"{cluster.intra.busbw / 1e9:g} GB/s, network {cluster.node_net_bytes_s / 1e9:g} GB/s per node "
             f"({cluster.nics_per_node} NICs), {1e6 * cluster.net_latency_s:g} us per step between nodes",
             f"{'GPUs':>6} {'strategy':>8} {'step ms':>9} {'comm ms':>9} {'NVLink ms':>10} {'network ms':>11} "
             f"{'state GiB':>10}"]
    for r in rows:
        c = r["comm_parts_ms"]
        lines.append(f"{r['gpus']:>6} {r['strategy']:>8} {r['step_ms']:>9.1f} {r['comm_ms']:>9.1f} "
                     f"{c.get('nvlink', 0):>10.1f} {c.get('network', 0):>11.1f} {r['model_state_gib']:>10.2f}")
    for what, measure in (("communication", total_comm_s), ("step", step_s)):
        where = hybrid_overtakes_zero3(cluster, w, measure)
        lines.append(f"# hybrid sharding's {what} is shorter than ZeRO-3's from {where} GPUs on" if where else
                     f"# hybrid sharding's {what} is never shorter than ZeRO-3's here (up to 65536 GPUs)")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    cluster, work = from_args(a)
    rows = predict(cluster, work, a.gpus)
    if a.json:
        print(json.dumps({"cluster": asdict(cluster), "workload": asdict(work), "rows": rows,
                          "hybrid_comm_shorter_from": hybrid_overtakes_zero3(cluster, work),
                          "hybrid_step_shorter_from": hybrid_overtakes_zero3(cluster, work, step_s)}, indent=1))
    else:
        print(format_table(rows, cluster, work))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
