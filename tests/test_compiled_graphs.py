"""torch.compile's CUDA graphs (mode="reduce-overhead") and a communicator's end
(pynccl/comm/compiled_graphs.py): NCCL does not finish a destroy or an abort while a graph that
captured the communicator's collectives is alive, and torch's tree manager keeps its graphs until
the process ends, so the NCCL backend drops them first.

* CPU: the helper never imports inductor's CUDA-graph trees, drops them (torch._dynamo.reset) only
  where this thread holds a tree manager, and the NCCL backend's destroy and abort call it before
  the communicator's.
* 2 GPUs: a function compiled with mode="reduce-overhead" around pynccl's traced all-reduce gives
  the sum on every replay (new inputs each call); a subgroup's destroy drops the graphs and the
  function, called again, compiles anew and still sums; destroy_process_group then returns in
  seconds, not after the group's timeout (it waited that long, then failed, before).
"""
import sys
import time
import types

import pytest
import torch

import pynccl
from pynccl.comm import compiled_graphs
from pynccl.comm.backends.nccl import NcclBackend
from pynccl.testing import run_multiprocess

TREES = "torch._inductor.cudagraph_trees"


def test_nothing_to_drop_without_inductor_graph_trees(monkeypatch):
    monkeypatch.delitem(sys.modules, TREES, raising=False)
    assert compiled_graphs.drop_compiled_cuda_graphs() is False
    assert TREES not in sys.modules, "the helper must not import inductor"


def _fake_trees(monkeypatch, holds=True):
    """Inductor's CUDA-graph trees stood in (loaded; this thread holds a tree manager or not), and
    torch._dynamo.reset recorded: [] until something drops the graphs."""
    dropped = []
    monkeypatch.setitem(sys.modules, TREES, types.SimpleNamespace())
    monkeypatch.setattr(compiled_graphs, "_holds_trees", lambda trees: holds)
    import torch._dynamo
    monkeypatch.setattr(torch._dynamo, "reset", lambda: dropped.append("graphs dropped"))
    return dropped


def test_held_trees_are_dropped_through_dynamo_reset(monkeypatch):
    dropped = _fake_trees(monkeypatch)
    assert compiled_graphs.drop_compiled_cuda_graphs() is True
    assert dropped == ["graphs dropped"]


def test_nothing_dropped_where_this_thread_holds_no_trees(monkeypatch):
    dropped = _fake_trees(monkeypatch, holds=False)
    assert compiled_graphs.drop_compiled_cuda_graphs() is False
    assert dropped == []


def test_holds_trees_reads_torchs_thread_local_containers():
    """On this thread no reduce-overhead function ran: no tree manager (torch's real module)."""
    import torch._inductor.cudagraph_trees as trees
    assert compiled_graphs._holds_trees(trees) is False


@pytest.mark.parametrize("end", ["destroy", "abort"])
def test_nccl_backend_drops_graphs_before_its_communicator(monkeypatch, end):
    order = _fake_trees(monkeypatch)

    class Comm:
        def destroy(self):
            order.append("comm.destroy")

        def abort(self):
            order.append("comm.abort")

    backend = object.__new__(NcclBackend)     # no communicator: only the order of the two calls is tested
    backend.comm = Comm()
    getattr(backend, end)()
    assert order == ["graphs dropped", f"comm.{end}"]


def _graphs_case(rank, world):
    from pynccl.comm.functional_collectives import all_reduce
    device = torch.device("cuda", torch.cuda.current_device())

    @torch.compile(mode="reduce-overhead")
    def summed(x):
        return all_reduce(x * 2) + 1

    for step in range(5):                       # warm-up, recording, then replays
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.full((1024,), float(rank + step), device=device)
        got = summed(x).clone()
        want = 2 * sum(r + step for r in range(world)) + 1
        assert torch.equal(got, torch.full_like(got, want)), f"step {step}: {got[:4].tolist()} != {want}"
    assert compiled_graphs._holds_trees(sys.modules[TREES])
    # a subgroup's destroy mid-run drops the graphs (and dynamo's frames): the function compiles and
    # records anew, on the default group's communicator, which lives on
    sub = pynccl.new_group(list(range(world)))
    pynccl.all_reduce(torch.ones(4, device=device), group=sub)
    pynccl.destroy_process_group(sub)
    for step in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.full((1024,), float(rank * step), device=device)
        got = summed(x).clone()
        want = 2 * sum(r * step for r in range(world)) + 1
        assert torch.equal(got, torch.full_like(got, want)), f"after the drop, step {step}: {got[:4].tolist()}"
    torch.cuda.synchronize()
    start = time.monotonic()
    pynccl.destroy_process_group()
    return time.monotonic() - start


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_destroy_after_reduce_overhead_graphs_returns_promptly():
    took = run_multiprocess(_graphs_case, 2, backend="nccl", start_method="spawn", timeout=300,
                            init_kwargs=dict(timeout=60))
    assert max(took) < 20, f"destroy_process_group took {took} s (the group's timeout is 60 s)"
