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

"expected" is the peak replayed from the shard layouts, allocation by allocation, in the order
the implementation allocates and frees (expected_peak); "named" = expected - formula, listed by
role (fp32 gradient shards, reduce-scatter buffers, gathered units, padding); "ratio" =
measured / (formula + named). On CUDA the same is done for max_memory_allocated, with the
activations and backward temporaries of the unwrapped bf16 model (same batch) named too: they
are held while backward makes its last gradient, so the expected peak is the larger of the
model-state peak and the model states at that moment (replayed too) plus those temporaries.
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
    # The unwrapped baseline runs in bf16; the ZeRO wrapper casts its inputs itself.
    return net, lambda m: m(x.to(next(m.parameters()).dtype))


# ----------------------------------------------------------------------------- expected
ROLES = ["params_full", "params_shard", "grads_unreduced", "grads_in_flight", "grads_shard", "optim"]


class _Timeline:
    """Bytes held per role, replayed allocation by allocation; keeps the largest total seen."""

    def __init__(self, **held):
        self.held = dict.fromkeys(ROLES, 0)
        self.held.update(held)
        self.peak = dict(self.held)
        self.marks = {}

    def mark(self, name):
        """Remember the total held now, as `name`."""
        self.marks[name] = sum(self.held.values())

    def add(self, role, nbytes):
        self.held[role] += nbytes
        if nbytes > 0 and sum(self.held.values()) > sum(self.peak.values()):
            self.peak = dict(self.held)


def expected_peak(stage, units, root=None, forward_order=None, compute=2, reduce=2, master=4, optim_per_elem=8,
                  marks=None, stage3_in_flight=1, ring_slots=0):
    """{role: bytes} at the largest point of one training step, replayed from the shard layouts
    in the order the implementation allocates and frees (pynccl/zero/stage12.py, stage3.py,
    flat_unit.py): what the implementation is built to hold, to set against the measurement.

    units: the wrapper's units (stage 1/2: in reduce order, = backward order); stage 3: `root`,
    the root unit's index (None if there is none) and `forward_order`, the other units' indices
    as forward runs them. Element sizes in bytes: compute and reduce dtypes (bf16), master dtype
    and optimizer state per element (AdamW: two fp32 moments). stage3_in_flight: how many stage-3
    reduce-scatters are still running after each start (1: the collective keeps up with backward;
    more where it lags, as gloo's threads can on a busy machine). If `marks` is a dict, it gets
    "last_grad": the total held when backward makes its last gradient (before that gradient's
    reduction starts), where backward's own temporaries peak too (see measure_unwrapped).
    ring_slots (stage 3): the blocks gather into a ring of that many slots of one symmetric window
    (zero/gather_ring.py), each the largest block's gathered bytes, 4096-aligned: held throughout,
    and no block gather allocates (the normal flow never finds its slot taken)."""
    P = [u.layout.padded_numel for u in units]
    S = [u.layout.shard_numel for u in units]
    numel = [u.layout.numel for u in units]
    tl = _Timeline(params_shard=master * sum(S), optim=optim_per_elem * sum(S))
    in_flight = []                                    # (unit, input bytes, output bytes), oldest first

    def launch(i, grad_bytes, inp_is_grad):
        """reduce_grad, then the wrapper drops the gradient: an input buffer in the reduce dtype
        (stage 3 with compute == reduce hands over the flat gradient itself) and the output shard."""
        inp = grad_bytes if inp_is_grad else reduce * P[i]
        if not inp_is_grad:
            tl.add("grads_in_flight", inp)
        tl.add("grads_in_flight", reduce * S[i])
        tl.add("grads_unreduced", -grad_bytes)
        if inp_is_grad:
            tl.add("grads_in_flight", inp)
        in_flight.append((i, inp, reduce * S[i]))
        # Stages 1/2 finish the oldest beyond MAX_IN_FLIGHT (ReduceQueue.trim). Stage 3 never
        # waits: it finishes those already complete (trim_completed); here all but the newest
        # stage3_in_flight are taken to be complete by then.
        while len(in_flight) > (MAX_IN_FLIGHT if stage in (1, 2) else stage3_in_flight):
            finish()

    def finish():
        """finish_reduce: the input buffer goes once the reduce-scatter is done; the shard
        gradient in the master dtype (a cast allocates it, else the output becomes it); the
        output goes."""
        j, inp, out = in_flight.pop(0)
        tl.add("grads_in_flight", -inp)
        if reduce != master:
            tl.add("grads_shard", master * S[j])
            tl.add("grads_in_flight", -out)
        else:
            tl.add("grads_in_flight", -out)
            tl.add("grads_shard", out)

    if stage in (1, 2):
        tl.add("params_full", compute * sum(P))
        # A unit of one unpadded parameter whose gradient is already in the reduce dtype
        # reduce-scatters that gradient itself (flat_unit.reduce_grad); others pack a copy.
        own = [len(u.layout.slots) == 1 and numel[i] == P[i] and compute == reduce for i, u in enumerate(units)]
        for i in range(len(units)):                   # backward: the bucket's gradients appear
            tl.add("grads_unreduced", compute * numel[i])
            if i == len(units) - 1:
                tl.mark("last_grad")
            if stage == 2:
                launch(i, compute * numel[i], inp_is_grad=own[i])
        if stage == 1:                                # reduced after backward, bucket by bucket
            for i in range(len(units)):
                launch(i, compute * numel[i], inp_is_grad=own[i])
    else:
        order = list(forward_order)
        if root is not None:
            tl.add("params_full", compute * P[root])
        if ring_slots and order:
            slot = -(-compute * max(P[i] for i in order) // 4096) * 4096
            tl.add("params_full", ring_slots * slot)

        def gathered(i, sign):                        # a block gathered (+1) or freed (-1)
            if not ring_slots:
                tl.add("params_full", sign * compute * P[i])
        for k, i in enumerate(order):                 # forward: current unit + the prefetched next
            if k == 0:
                gathered(i, 1)
            if k + 1 < len(order):
                gathered(order[k + 1], 1)
            if k + 1 < len(order):                    # the last unit stays gathered for backward
                gathered(i, -1)
        if root is not None:                          # the root's flat gradient, from backward's start
            tl.add("grads_unreduced", compute * P[root])
        for k, i in enumerate(reversed(order)):
            prev = order[len(order) - 2 - k] if k + 1 < len(order) else None
            if prev is not None:
                gathered(prev, 1)                     # prefetched for its backward
            tl.add("grads_unreduced", compute * P[i])
            if root is None and k == len(order) - 1:
                tl.mark("last_grad")
            launch(i, compute * P[i], inp_is_grad=compute == reduce)
            gathered(i, -1)
        if root is not None:                          # the root (embeddings) completes last
            tl.mark("last_grad")
            launch(root, compute * P[root], inp_is_grad=compute == reduce)
            tl.add("params_full", -compute * P[root])
    while in_flight:
        finish()
    if marks is not None:
        marks.update(tl.marks)
    return tl.peak


def named_items(stage, n, psi, peak):
    """The expected peak minus the paper's formula, by role: what this implementation holds
    beyond (or below) the formula, each item named."""
    f_params, f_grads = (2 * psi, 2 * psi) if stage == 1 else (2 * psi, 2 * psi / n) if stage == 2 else \
        (2 * psi / n, 2 * psi / n)
    fp32_master = 4 * psi / n
    return {
        "parameters beyond the formula's (stage 3: root + gathered units, no bf16 shard; padding)":
            peak["params_full"] + peak["params_shard"] - f_params - fp32_master,
        "gradients beyond the formula's (fp32 shard gradients, reduce-scatter buffers, unreduced grads)":
            peak["grads_unreduced"] + peak["grads_in_flight"] + peak["grads_shard"] - f_grads,
        "optimizer state beyond 8 Psi/N (shard padding)": peak["optim"] - 8 * psi / n,
    }


# ----------------------------------------------------------------------------- measuring
class PeakSampler:
    """Largest memory_bytes() total seen at any sample point, with its breakdown."""

    def __init__(self, model, opt):
        self.model, self.opt, self.peak, self.handles = model, opt, {"total": -1}, []
        self.active = False
        self.max_in_flight = 0       # most reduce-scatters seen pending at once (sampled after each start)

    def sample(self, *unused):
        if self.active:
            self.max_in_flight = max(self.max_in_flight, len(self.model._runtime.in_flight.pending))
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
        for obj, names in [(u, ("finish_reduce", "gather", "wait_gather")) for u in rt.units] + [
                (rt.in_flight, ("append", "trim"))]:
            for name in names:
                real = getattr(obj, name)
                setattr(obj, name, lambda *a, _real=real: (_real(*a), self.sample())[0])


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
    rt = model._runtime
    marks = {}
    order = dict(root=rt.root.index if stage == 3 and rt.root is not None else None,
                 forward_order=[u.index for u in rt.forward_order] if stage == 3 else None)
    if stage == 3 and rt.gather_ring is not None:
        order["ring_slots"] = len(rt.gather_ring)
    expected = expected_peak(stage, model.units, marks=marks, **order)
    n = model.process_group.world_size
    result = dict(stage=stage, num_params=num_params, peak=sampler.peak, expected=expected,
                  named=named_items(stage, n, num_params, expected), expected_at_last_grad=marks["last_grad"])
    if stage == 3:
        # The same replay with as many reduce-scatters running as this run had at most: an upper
        # bound for this run, whatever the timing (more in flight only holds more buffers).
        result["max_in_flight"] = sampler.max_in_flight
        result["expected_lagging"] = expected_peak(3, model.units, stage3_in_flight=max(1, sampler.max_in_flight),
                                                   **order)
    if cuda:
        torch.cuda.synchronize()
        result["cuda_max_allocated"] = torch.cuda.max_memory_allocated() - base
    opt.zero_grad(set_to_none=True)
    del model, opt, net, sampler
    return result


def measure_unwrapped(args, device):
    """Activations and backward temporaries of one step of the model in bf16, unwrapped (CUDA):
    the peak allocated beyond its parameters and gradients. ZeRO adds the same on top of the
    model states held at that moment. For this batch (1 x 64 tokens) activations are small and
    the peak is backward's end, where the tied embedding's two bf16 gradients (head and
    embedding, 50304 x 768 each) are summed: the replay's "last_grad" mark."""
    net, loss_fn = make_model(args, device)
    net.to(device=device, dtype=torch.bfloat16)
    loss_fn(net).backward()                           # warm-up (cuBLAS workspaces, etc.)
    net.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss_fn(net).backward()
    torch.cuda.synchronize()
    grads = sum(p.grad.untyped_storage().nbytes() for p in net.parameters() if p.grad is not None)
    transient = torch.cuda.max_memory_allocated() - before - grads
    del net, loss_fn
    torch.cuda.empty_cache()
    return transient


def worker(rank, world_size, args):
    device = pynccl.get_device()
    out = []
    transient = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        transient = measure_unwrapped(args, device)
    for stage in (1, 2, 3):
        out.append(measure(stage, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(rank=rank, world_size=world_size, results=out, activations=transient)


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
    cuda = any("cuda_max_allocated" in res for r in per_rank for res in r["results"])
    print(f"# ZeRO model-state memory per rank, {device_name}; bf16 compute/reduce, fp32 master + AdamW; MiB")
    print("# measured: peak of model-state storages; expected: replayed from the layouts (expected_peak); "
          "named = expected - formula; ratio = measured / (formula + named)")
    print(f"{'N':>2} {'stage':>5} {'rank':>4} {'params':>9} {'grads':>9} {'optim':>9} {'measured':>9} "
          f"{'x Psi':>6} {'formula':>9} {'named':>8} {'ratio':>6}")
    for r, n, res, psi, formula, named in rows(per_rank):
        p = res["peak"]
        print(f"{n:>2} {res['stage']:>5} {r['rank']:>4} {p['params'] * mib:>9.2f} {p['grads'] * mib:>9.2f} "
              f"{p['optim'] * mib:>9.2f} {p['total'] * mib:>9.2f} {p['total'] / psi:>6.2f} {formula * mib:>9.2f} "
              f"{named * mib:>8.2f} {p['total'] / (formula + named):>6.3f}")
    if cuda:
        print("\n# torch.cuda.max_memory_allocated over the step: it adds activations and backward temporaries "
              "(activ., measured on the unwrapped bf16 model with the same batch), which are held while backward "
              "makes its last gradient; expected = max(formula + named, model states then + activ.); bound = "
              "formula + named + activ., as if both peaks coincided")
        print(f"{'N':>2} {'stage':>5} {'rank':>4} {'cuda max':>9} {'formula':>9} {'named':>8} {'at last':>8} "
              f"{'activ.':>8} {'expected':>9} {'ratio':>6} {'/ bound':>7}")
        for r, n, res, psi, formula, named in rows(per_rank):
            act = r.get("activations") or 0
            m = res["cuda_max_allocated"]
            at_last = res["expected_at_last_grad"]
            expected = max(formula + named, at_last + act)
            print(f"{n:>2} {res['stage']:>5} {r['rank']:>4} {m * mib:>9.2f} {formula * mib:>9.2f} {named * mib:>8.2f} "
                  f"{at_last * mib:>8.2f} {act * mib:>8.2f} {expected * mib:>9.2f} {m / expected:>6.3f} "
                  f"{m / (formula + named + act):>7.3f}")
    print("\n# what is held at the peak, by role (MiB), measured / expected: full = compute-dtype parameters "
          "(stage 3: gathered units), shard = fp32 masters; grads unreduced / in flight (reduce-scatter buffers) / "
          "fp32 shards")
    print(f"{'N':>2} {'stage':>5} {'rank':>4} " + " ".join(f"{r:>17}" for r in ROLES))
    for r, n, res, psi, formula, named in rows(per_rank):
        d = dict(res["peak"]["detail"], optim=res["peak"]["optim"])
        e = res["expected"]
        print(f"{n:>2} {res['stage']:>5} {r['rank']:>4} " + " ".join(
            f"{f'{d[k] * mib:.2f}/{e[k] * mib:.2f}':>17}" for k in ROLES))
    if show_items:
        seen = set()
        print("\n# named (MiB) = expected - formula, per stage and N")
        for r, n, res, psi, formula, named in rows(per_rank):
            if (n, res["stage"]) in seen:
                continue
            seen.add((n, res["stage"]))
            items = "; ".join(f"{k} {v * mib:+.2f}" for k, v in res["named"].items() if abs(v) >= 2**10)
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
