"""benchmarks/graph_breaks.py on gloo (2 ranks, aot_eager), and what it guards in pynccl's wrappers
under torch.compile:

* DDP compiled whole (torch.compile(ddp)): its bookkeeping around the module runs eagerly, so the
  model is one graph, compiled once, every op in it (traced, the buffer broadcast and the walk of
  the autograd graph broke it 14 times into 7 graphs and recompiled 4 of them on later steps).
* DDP takes part in dynamo's DDPOptimizer like torch DDP: the compiled graph of a model bigger than
  one bucket is split at bucket boundaries, and the gradients still equal one process's.
* ZeRO-3 compiled whole or inner (nanoGPT's order) runs as much of the model in graphs as FSDP2
  does and never hits dynamo's recompile limit (its saved-tensor hook was recompiled per tensor
  kind until the limit, then run eagerly); per block it is one graph per block, like the plain model.
* Per-block compilation (torchtitan's recipe) of DDP / ZeRO-1/2/3 wraps with no break at all.
* TP compiled whole or per block is one graph with no break: its collectives are pynccl's custom
  ops (comm/functional_collectives.py; called from dynamo-traced code they broke the graph at each
  collective: 47 breaks and 23 graphs whole, 23 and 9 per block), and every op of the model runs in
  it. tests/test_tp_compile.py checks the collectives in the forward and backward graphs and the
  compiled numerics.
"""
import os
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (once, before the ranks fork)

import graph_breaks  # noqa: E402
import pynccl  # noqa: E402
from pynccl.testing import run_multiprocess  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    result = graph_breaks.main(["--models", "hf-llama,nanogpt", "--wrappers", "none,ddp,zero1,zero3,fsdp2,tp",
                                "--modes", "whole,inner,blocks", "--layers", "3"])
    return {(r["model"], r["wrapper"], r["mode"]): r for r in result}


def _ok(r):
    assert "breaks" in r, r.get("error") or r.get("na")
    assert r["limit_hits"] == 0 and r["recompiled"] == 0, r
    return r


def test_plain_models_compile_whole(rows):
    for model in ("hf-llama", "nanogpt"):
        for mode in ("whole", "blocks"):
            r = _ok(rows[(model, "none", mode)])
            assert r["breaks"] == 0 and r["graphs"] == 1 and r["ops_vs_plain"] == 1.0


def test_ddp_compiled_whole_is_one_graph(rows):
    for model in ("hf-llama", "nanogpt"):
        r = _ok(rows[(model, "ddp", "whole")])
        assert r["graphs"] == 1 and r["ops_vs_plain"] == pytest.approx(1.0), r
        assert r["breaks"] <= 5, r["reasons"]        # around the module: its bookkeeping, the DDP scope
        assert _ok(rows[(model, "ddp", "inner")])["breaks"] == 0


def test_blocks_compile_without_breaks(rows):
    for model in ("hf-llama", "nanogpt"):
        for wrapper in ("ddp", "zero1", "zero3", "fsdp2"):
            r = _ok(rows[(model, wrapper, "blocks")])
            assert r["breaks"] == 0 and r["graphs"] == 1 and r["ops_vs_plain"] == 1.0, (wrapper, r)


def test_tp_compiles_without_breaks(rows):
    for mode in ("whole", "blocks"):
        r = _ok(rows[("hf-llama", "tp", mode)])
        assert r["breaks"] == 0 and r["graphs"] == 1, (mode, r["reasons"])
        assert r["ops_vs_plain"] >= 1.0, r             # no op of the model left outside a graph


def test_zero3_compiled_whole_matches_fsdp2(rows):
    for model in ("hf-llama", "nanogpt"):
        fsdp2 = _ok(rows[(model, "fsdp2", "whole")])
        for mode in ("whole", "inner"):
            r = _ok(rows[(model, "zero3", mode)])
            assert r["ops_vs_plain"] >= fsdp2["ops_vs_plain"] - 0.02, (model, mode, r, fsdp2)
        assert _ok(rows[(model, "zero1", "whole")])["ops_vs_plain"] == 1.0


def test_not_applicable_cases_say_why(rows):
    assert "no TP plan" in rows[("nanogpt", "tp", "blocks")]["na"]
    assert "OptimizedModule" in rows[("hf-llama", "tp", "inner")]["na"]
    table = graph_breaks.format_table(list(rows.values()))
    assert table.splitlines()[0].split()[:4] == ["model", "wrapper", "mode", "breaks"]


# ----------------------------------------------------------------------------- DDPOptimizer
class _Deep(torch.nn.Module):
    """Four 600x600 fp32 layers (1.4 MB each): more than DDPOptimizer's 1 MiB first bucket and
    than a 2 MB bucket, so its splitting shows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(600, 600) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _split_case(rank, world):
    import collections
    tally = collections.Counter()

    def backend(gm, example_inputs):
        tally["graphs"] += 1
        return gm.forward
    torch._dynamo.reset()
    ref = _Deep()
    x = torch.randn(8, 600, generator=torch.Generator().manual_seed(1))
    ref(x).backward()
    ddp = pynccl.DistributedDataParallel(torch.compile(_Deep(), backend=backend), bucket_cap_mb=2)
    seen = []
    ddp.module._orig_mod.register_forward_pre_hook(
        lambda *a: seen.append(torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()))
    half = x[rank * 4:(rank + 1) * 4]
    ddp(half).backward()
    for p, q in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is None
    return tally["graphs"], seen[0] is ddp


def test_ddp_graph_is_split_at_buckets():
    """pynccl.DistributedDataParallel(torch.compile(model)), nanoGPT's order: while the module runs,
    dynamo sees the wrapper as the active DDP module and DDPOptimizer compiles the graph in pieces
    (one, unsplit, without it); the averaged gradients equal one process's on the whole batch."""
    results = run_multiprocess(_split_case, 2, timeout=600)
    for graphs, active in results:
        assert active and graphs >= 3, (graphs, active)
