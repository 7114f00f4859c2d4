"""benchmarks/zero_memory.py on gloo: the model-state bytes a ZeRO rank holds at its peak equal
what the implementation is built to hold (replayed from the shard layouts), and that is the
ZeRO paper's formula plus the named buffers, within 5%, at world sizes 1 and 3 (uneven shards)."""
import argparse
import importlib.util
import os

import pytest

from pynccl.testing import run_multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_bench():
    spec = importlib.util.spec_from_file_location("zero_memory", os.path.join(ROOT, "benchmarks", "zero_memory.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("world_size", [1, 3])
def test_measured_model_state_matches_formula_plus_named(world_size):
    bench = _load_bench()
    args = argparse.Namespace(model="mlp", dim=64, layers=6, batch=4, bucket_cap_mb=0.05)
    per_rank = run_multiprocess(bench.worker, world_size, backend="gloo", timeout=300, args=(args,))
    assert len(per_rank) == world_size
    for r, n, res, psi, formula, named in bench.rows(per_rank):
        measured, expected = res["peak"]["total"], sum(res["expected"].values())
        where = f"N={n} stage {res['stage']} rank {r['rank']}"
        assert formula + named == pytest.approx(expected), where
        # The sampler sees most, not all, of the transient peaks the replay includes; the replay
        # takes gradients to arrive bucket by bucket (a few may come a bucket early): +1 % for
        # stages 1/2. Stage 3 frees a reduce-scatter's buffers once it has completed, never
        # waiting for it, so how many are still running at the peak depends on gloo's threads (one
        # more lagging was +3 %, two +5.5 %, on a busy 2-core machine; all of them until the end of
        # backward would be +40 %): its bound is the replay with as many running as this run had at
        # most (expected_lagging), and its floor the replay where the collective keeps up.
        if res["stage"] == 3:
            upper = 1.02 * sum(res["expected_lagging"].values())
            assert res["max_in_flight"] >= 1, where
        else:
            upper = 1.01 * expected
        assert 0.95 * expected <= measured <= upper, \
            f"{where}: measured {measured} vs expected {expected} (bound {upper:.0f})"
        assert measured >= formula * (0.99 if res["stage"] == 3 else 1.0), f"{where}: below the paper's formula"
        for role in ("params_full", "params_shard", "grads_shard", "optim"):
            got = res["peak"]["optim"] if role == "optim" else res["peak"]["detail"][role]
            bound = res["expected"][role]
            if role == "grads_shard" and res["stage"] == 3:
                # How many reduces have finished at the peak depends on timing (see above): at
                # most every shard's gradient, as many fp32 elements as the parameter shards.
                bound = res["expected"]["params_shard"]
            assert got <= bound * 1.001 + 1024, f"{where}: {role} {got} > {bound}"
