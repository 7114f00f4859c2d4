"""The scaling model (scaling_model.py) against a run: N torchrun agents on this host
(pynccl.testing.multinode), the network between them loopback sockets (NCCL's socket transport
on GPUs, gloo on CPU). The job measures what the model takes (compute per step without
communication; latency and bus bandwidth inside a node and across nodes, fitted from all-gathers
at two sizes), then the step of DDP, ZeRO-3 and hybrid ZeRO-3 on a small MLP, and the model
predicts those steps from the measured inputs; the table puts both side by side.

    python benchmarks/scaling_check.py --backend gloo --nnodes 2 --nproc-per-node 2     # CPU
    NCCL_NVLS_ENABLE=0 python benchmarks/scaling_check.py --backend nccl --nnodes 2 --nproc-per-node 1

The prediction is a range: communication fully exposed (overlap 0) to fully hidden (overlap 1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scaling_model as sm  # noqa: E402

WIDTH, LAYERS, BATCH = 512, 4, 32


class MLP(nn.Module):
    """LAYERS residual blocks (the ZeRO-3 units) and a head (the root unit)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
                                    for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).pow(2).mean()


# ---------------------------------------------------------------------- worker (under torchrun)
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device, reps, group=None):
    import pynccl
    times = []
    for i in range(reps + 1):
        pynccl.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i:                                          # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_link(group, device, small, large, reps) -> sm.Link:
    """Latency per ring step and busbw from all-gathers of `small` and `large` bytes (the model's
    all_gather_s solved for its two unknowns)."""
    import pynccl
    n = group.world_size
    if n == 1:
        return sm.Link(0.0, float("inf"))
    t = {}
    for size in (small, large):
        count = max(1, size // 4 // n)
        inp = torch.ones(count, device=device)
        out = torch.empty(count * n, device=device)
        t[size] = _median_s(lambda: pynccl.all_gather_into_tensor(out, inp, group=group), device, reps, group)
    bytes_small, bytes_large = 4 * max(1, small // 4 // n) * n, 4 * max(1, large // 4 // n) * n
    busbw = (n - 1) / n * (bytes_large - bytes_small) / max(t[large] - t[small], 1e-9)
    latency = max(0.0, (t[small] - (n - 1) / n * bytes_small / busbw) / (n - 1))
    return sm.Link(latency, busbw)


def _train_step_s(model, opt, x, device, reps):
    def step():
        model(x).backward()
        opt.step()
        opt.zero_grad()
    step()
    return _median_s(step, device, reps)


def worker(out_path, reps):
    import pynccl
    from pynccl.comm.nodes import node_layout
    backend = os.environ.get("SCALING_BACKEND", "gloo")
    pynccl.init_process_group(backend, timeout=300)
    rank, n = pynccl.get_rank(), pynccl.get_world_size()
    device = pynccl.get_device()
    layout = node_layout()
    g = layout.ranks_per_node
    node_groups, rail_groups = [pynccl.new_group(r) for r in layout.nodes], \
        [pynccl.new_group(r) for r in layout.inter_node_groups()]
    # new_group gives torch's GroupMember.NON_GROUP_MEMBER (an int) to the ranks outside a group
    node = next(x for x in node_groups if isinstance(x, pynccl.ProcessGroup) and rank in x.ranks)
    rail = next(x for x in rail_groups if isinstance(x, pynccl.ProcessGroup) and rank in x.ranks)
    small, large = 8, (64 << 20) if device.type == "cuda" else (4 << 20)
    intra = fit_link(node, device, small, large, reps)
    world = fit_link(pynccl.get_default_group(), device, small, large, reps)
    rail_link = fit_link(rail, device, small, large, reps)

    torch.manual_seed(0)
    x = torch.randn(BATCH, WIDTH, device=device)
    net = MLP().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    compute = _train_step_s(net, opt, x, device, reps)  # every rank at once, as in training
    steps = {}
    for name, make in (("ddp", lambda m: pynccl.DistributedDataParallel(m)),
                       ("zero3", lambda m: pynccl.FullyShardedDataParallel(m, stage=3)),
                       ("hybrid", lambda m: pynccl.FullyShardedDataParallel(m, stage=3, process_group=(node, rail)))):
        torch.manual_seed(0)
        model = make(MLP().to(device))
        steps[name] = _train_step_s(model, torch.optim.SGD(model.parameters(), lr=1e-3), x, device, reps)
    if rank == 0:
        params = sum(p.numel() for p in MLP().parameters())
        with open(out_path, "w") as f:
            json.dump({"gpus": n, "gpus_per_node": g, "params": params, "compute_s": compute, "steps_s": steps,
                       "links": {"intra": intra.__dict__, "world": world.__dict__, "rail": rail_link.__dict__},
                       "backend": backend, "device": str(device)}, f)
    pynccl.destroy_process_group()


# ---------------------------------------------------------------------- driver
def predictions(m: dict) -> dict:
    """strategy -> (step with communication exposed, step with it hidden) from the measured inputs."""
    g, links = m["gpus_per_node"], {k: sm.Link(**v) for k, v in m["links"].items()}
    # NOTE: the rail link is measured: on one host the "nodes" share no NIC whose rate would split
    # among the GPUs of a node, which is what the model assumes of a cluster.
    cluster = sm.Cluster(g, links["intra"], links["world"].busbw, nics_per_node=g,
                         net_latency_s=links["world"].latency_s, net_efficiency=1.0, rail=links["rail"])
    out = {}
    for s in sm.STRATEGIES:
        bounds = []
        for overlap in (0.0, 1.0):
            w = sm.Workload(m["params"], m["compute_s"], units=LAYERS, param_bytes=4, grad_bytes=4, overlap=overlap)
            bounds.append(sm.step_s(s, m["gpus"], cluster, w))
        out[s] = bounds
    return out


def report(m: dict) -> str:
    pred = predictions(m)
    lines = [f"# {m['gpus']} ranks = {m['gpus'] // m['gpus_per_node']} nodes × {m['gpus_per_node']} on one host, "
             f"{m['backend']} ({m['device']}), MLP {WIDTH}×{LAYERS} blocks, {m['params']:,} parameters, "
             f"batch {BATCH} per rank",
             f"# measured: compute {1e3 * m['compute_s']:.2f} ms/step; " + "; ".join(
                 f"{k} {1e6 * v['latency_s']:.1f} us/step {v['busbw'] / 1e9:.3f} GB/s" for k, v in m["links"].items()),
             f"{'strategy':>8} {'measured ms':>12} {'model ms (exposed .. hidden)':>30} {'measured / exposed':>19}"]
    for s in sm.STRATEGIES:
        lo, hi = pred[s][1], pred[s][0]
        lines.append(f"{s:>8} {1e3 * m['steps_s'][s]:>12.2f} {1e3 * hi:>17.2f} .. {1e3 * lo:>8.2f} "
                     f"{m['steps_s'][s] / hi:>19.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the measurements and predictions here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.reps)
        return 0
    from pynccl.testing.multinode import run_nodes
    out = os.path.join(tempfile.mkdtemp(prefix="scaling_check_"), "measured.json")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"SCALING_BACKEND": a.backend, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    run_nodes([os.path.abspath(__file__), "--worker", out, "--reps", str(a.reps)], a.nnodes, a.nproc_per_node,
              timeout=600, env=env)
    with open(out) as f:
        measured = json.load(f)
    print(report(measured))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"measured": measured, "predicted": predictions(measured)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
