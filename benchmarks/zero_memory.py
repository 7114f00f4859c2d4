"""Per-rank memory of model states under ZeRO stages 1-3, next to the ZeRO paper's formulas
for mixed-precision Adam (arXiv:1910.02054 §5.1; Ψ parameters, N ranks): no sharding 16Ψ,
stage 1 4Ψ+12Ψ/N, stage 2 2Ψ+14Ψ/N, stage 3 16Ψ/N.

    python benchmarks/zero_memory.py                        # gloo, N = 1..4 (processes launched here)
    python benchmarks/zero_memory.py --device cuda          # one GPU, world size 1
    torchrun --nproc_per_node 4 benchmarks/zero_memory.py --device cuda

"measured" is the peak, over one training step taken after a warm-up step created the
optimizer state, of the bytes in the distinct storages of parameters (compute copies, gathered
units, fp32 master shards), gradients (unreduced, in-flight reduce-scatter buffers, shards)
and optimizer state (FullyShardedDataParallel.memory_bytes), sampled wherever memory can
grow: around every module's forward, before every block's backward, after every gradient
accumulation, after each reduce-scatter is started and finished, after backward and step.
Precision: bf16 compute and bf16 reduce (the paper's fp16 parameters and gradients), fp32
master shards and AdamW moments. With --device cuda, torch.cuda.max_memory_allocated over the
same step is printed too (it adds activations and temporaries; the batch is kept tiny).

"named" is the bound, computed from the shard layouts, of what the implementation holds on
top of the formula (each item is listed); "ratio" = measured / (formula + named).
"""
import argparse
import datetime
import json
import os
import platform
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pynccl  # noqa: E402
from pynccl.zero import MixedPrecision  # noqa: E402
from pynccl.zero.stage12 import MAX_IN_FLIGHT  # noqa: E402

FORMULA = {1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 16 / n}   # bytes per parameter


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MLP(nn.Module):
    """Residual MLP blocks in a ModuleList (stage-3 units), small input/output layers (root)."""

    def __init__(self, d=256, layers=16, io=64):
        super().__init__()
        self.inp, self.out = nn.Linear(io, d), nn.Linear(d, io)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h).float().square().mean()


def make_model(args, device):
    torch.manual_seed(0)
    if args.model == "gpt":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ddp_bench import GPT
        net = GPT()
        x = torch.randint(0, 50257, (1, 64), device=device)
        return net, lambda m: F.cross_entropy(m(x).float().flatten(0, 1), x.flatten())
    net = MLP(args.dim, args.layers)
    x = torch.randn(args.batch, 64, device=device)
    return net, lambda m: m(x)


# ----------------------------------------------------------------------------- bounds
def named_buffers(stage, units, n):
    """{item: bytes}: what this implementation holds beyond the paper's formula, bounded from
    the layouts. c = bytes of a bf16 element (compute and reduce dtype), units in order."""
    c = 2
    numel = sum(u.layout.numel for u in units)
    padded = sum(u.layout.padded_numel for u in units)
    shard = sum(u.layout.shard_numel for u in units)
    per_unit = sorted(((u.layout.padded_numel, u.layout.shard_numel) for u in units), reverse=True)
    top = lambda k, f: sum(f(p, s) for p, s in per_unit[:k])  # noqa: E731
    items = {"padding to equal shards": c * (padded - numel) * (stage < 3) + 12 * shard - 12 * numel / n}
    if stage == 1:
        items[f"{MAX_IN_FLIGHT} reduce-scatter buckets in flight"] = top(MAX_IN_FLIGHT, lambda p, s: c * (p + s))
        items["fp32 grad shards beyond the bf16 full grads"] = max(0.0, 4 * shard - c * numel)
    elif stage == 2:
        items[f"{MAX_IN_FLIGHT} reduce-scatter buckets in flight"] = top(MAX_IN_FLIGHT, lambda p, s: c * (p + s))
        items["grads of the bucket being filled"] = top(1, lambda p, s: c * p)
        items["fp32 grad shard (paper: bf16)"] = 4 * shard - c * numel / n
    else:
        root = units[0].layout.padded_numel          # the root unit comes first when it exists
        items["gathered: root + current + prefetched unit"] = c * root + top(2, lambda p, s: c * p)
        items["unit grads: accumulating + in flight"] = top(1 + MAX_IN_FLIGHT, lambda p, s: c * (p + s))
        items["fp32 grad shard (paper: bf16)"] = 4 * shard - c * numel / n
        items["no bf16 param shard kept (paper keeps one)"] = -c * numel / n
    return items


# ----------------------------------------------------------------------------- measuring
class PeakSampler:
    """Largest memory_bytes() total seen at any sample point, with its breakdown."""

    def __init__(self, model, opt):
        self.model, self.opt, self.peak, self.handles = model, opt, {"total": -1}, []
        self.active = False

    def sample(self, *unused):
        if self.active:
            m = self.model.memory_bytes(self.opt)
            if m["total"] > self.peak["total"]:
                self.peak = m

    def install(self):
        def after_forward(module, args, out):
            self.sample()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self.sample())
        for m in self.model.module.modules():
            self.handles.append(m.register_forward_pre_hook(lambda *a: self.sample()))
            self.handles.append(m.register_forward_hook(after_forward))
        rt = self.model._runtime
        leaves = [u.full for u in rt.units] if self.model.stage == 3 else [t for ls in rt.unit_leaves for t in ls]
        for t in leaves:                              # registered after the wrapper's: sampled after them
            self.handles.append(t.register_post_accumulate_grad_hook(lambda p: self.sample()))
        for u in rt.units:
            for name in ("reduce_grad", "finish_reduce", "gather", "wait_gather"):
                real = getattr(u, name)
                setattr(u, name, lambda *a, _real=real: (_real(*a), self.sample())[0])


def measure(stage, args, device):
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated() if cuda else 0
    net, loss_fn = make_model(args, device)
    num_params = sum(p.numel() for p in net.parameters())
    model = pynccl.FullyShardedDataParallel(net, stage=stage, bucket_cap_mb=args.bucket_cap_mb,
                                            mixed_precision=MixedPrecision(torch.bfloat16, torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    sampler = PeakSampler(model, opt)
    sampler.install()
    loss_fn(model).backward()                         # warm-up step: creates the optimizer state
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    sampler.active = True
    sampler.sample()
    loss_fn(model).backward()
    sampler.sample()
    opt.step()
    sampler.sample()
    result = dict(stage=stage, num_params=num_params, peak=sampler.peak,
                  named=named_buffers(stage, model.units, model.process_group.world_size))
    if cuda:
        torch.cuda.synchronize()
        result["cuda_max_allocated"] = torch.cuda.max_memory_allocated() - base
    opt.zero_grad(set_to_none=True)
    del model, opt, net, sampler
    return result


def worker(rank, world_size, args):
    device = pynccl.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = []
    for stage in (1, 2, 3):
        out.append(measure(stage, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(rank=rank, world_size=world_size, results=out)


# ----------------------------------------------------------------------------- report
def rows(per_rank):
    for r in per_rank:
        n = r["world_size"]
        for res in r["results"]:
            psi = res["num_params"]
            formula = FORMULA[res["stage"]](n) * psi
            named = sum(res["named"].values())
            yield r, n, res, psi, formula, named


def print_report(per_rank, device_name, show_items=True):
    mib = 1 / 2 ** 20
    print(f"# ZeRO model-state memory per rank, {device_name}; bf16 compute/reduce, fp32 master + AdamW; MiB")
    print(f"{'N':>2} {'stage':>5} {'rank':>4} {'params':>9} {'grads':>9} {'optim':>9} {'measured':>9} "
          f"{'x Psi':>6} {'formula':>9} {'named':>8} {'ratio':>6}" + (f" {'cuda max':>9}" if any(
              "cuda_max_allocated" in res for r in per_rank for res in r["results"]) else ""))
    for r, n, res, psi, formula, named in rows(per_rank):
        p = res["peak"]
        line = (f"{n:>2} {res['stage']:>5} {r['rank']:>4} {p['params'] * mib:>9.2f} {p['grads'] * mib:>9.2f} "
                f"{p['optim'] * mib:>9.2f} {p['total'] * mib:>9.2f} {p['total'] / psi:>6.2f} {formula * mib:>9.2f} "
                f"{named * mib:>8.2f} {p['total'] / (formula + named):>6.3f}")
        if "cuda_max_allocated" in res:
            line += f" {res['cuda_max_allocated'] * mib:>9.2f}"
        print(line)
    roles = ["params_full", "params_shard", "grads_unreduced", "grads_in_flight", "grads_shard"]
    print("\n# what is held at the peak, by role (MiB): full = compute-dtype parameters (stage 3: gathered "
          "units), shard = fp32 masters; grads unreduced / in flight (reduce-scatter buffers) / fp32 shards")
    print(f"{'N':>2} {'stage':>5} {'rank':>4} " + " ".join(f"{r:>15}" for r in roles) + f" {'optim':>9}")
    for r, n, res, psi, formula, named in rows(per_rank):
        d = res["peak"]["detail"]
        print(f"{n:>2} {res['stage']:>5} {r['rank']:>4} " + " ".join(f"{d[k] * mib:>15.2f}" for k in roles)
              + f" {res['peak']['optim'] * mib:>9.2f}")
    if show_items:
        seen = set()
        print("\n# named buffers (MiB), per stage and N")
        for r, n, res, psi, formula, named in rows(per_rank):
            if (n, res["stage"]) in seen:
                continue
            seen.add((n, res["stage"]))
            items = ", ".join(f"{k} {v * mib:.2f}" for k, v in res["named"].items() if abs(v) > 0)
            print(f"N={n} stage {res['stage']}: {items}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, nargs="*", default=None,
                   help="world sizes to run (default: 1 2 3 4 on cpu, 1 on cuda); ignored under torchrun")
    p.add_argument("--model", choices=["mlp", "gpt"], default=None, help="default: mlp on cpu, gpt (GPT-2 small) on cuda")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--json", help="also write the per-rank results here")
    args = p.parse_args()
    args.model = args.model or ("gpt" if args.device == "cuda" else "mlp")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("zero_memory: --device cuda needs a GPU")
    all_results = []
    if "RANK" in os.environ:                            # torchrun: one world size
        pynccl.init_process_group(backend)
        res = worker(pynccl.get_rank(), pynccl.get_world_size(), args)
        gathered = [None] * pynccl.get_world_size()
        pynccl.all_gather_object(gathered, res)
        pynccl.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
        all_results = gathered
    else:
        from pynccl.testing import run_multiprocess
        for n in args.nproc or ([1, 2, 3, 4] if args.device == "cpu" else [1]):
            all_results += run_multiprocess(worker, n, backend=backend, timeout=1800, args=(args,),
                                            start_method="spawn" if args.device == "cuda" else None)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, {platform.node()}, torch "
          f"{torch.__version__}, model {args.model}, Psi = {all_results[0]['results'][0]['num_params']:,}, "
          f"bucket_cap_mb {args.bucket_cap_mb}")
    print_report(all_results, name)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_results, f, indent=1)


if __name__ == "__main__":
    main()
