"""ZeRO-3's gather ring (zero/gather_ring.py) on CPU: gloo has no symmetric memory, so ordinary
tensors cut from one storage stand in for the window. The gathered values never depend on where
a gather lands; which gathers get a slot depends only on the program-ordered gathers and frees:
* the bookkeeping on its own: slot n mod R for the n-th gather, an ordinary buffer where that
  slot's occupant is still gathered, and two "ranks" replaying one program decide alike;
* the whole of stage 3 on gloo with the ring forced (forward, backward, evaluation, activation
  checkpointing of both kinds, a block skipped on one rank only, R from 1 to 4 for 7 units):
  every loss and parameter after SGD and AdamW steps is bit-identical to the run without the
  ring, both ranks make the same decisions, slots are taken, and refused only where R = 1;
* PYNCCL_CHECK_COLLECTIVES names the first decision that differs across ranks.
Remove the occupancy check in GatherRing.acquire and the first and second fail (a slot handed
out while its occupant is still read: wrong parameters).
"""
import pytest
import torch
from torch import nn

import pynccl
from pynccl.comm.symmetric import ALIGN_BYTES
from pynccl.errors import CollectiveMismatchError
from pynccl.testing import run_multiprocess
from pynccl.zero.gather_ring import GatherRing


def _slots(slot_bytes, count):
    """Stand-ins for alloc_symmetric's window: `count` uint8 buffers of one storage, aligned."""
    step = (slot_bytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
    window = torch.zeros(step * count, dtype=torch.uint8)
    return [window[i * step: i * step + slot_bytes] for i in range(count)]


class _Owner:
    def __init__(self, name):
        self.name, self.slot = name, None

    def __repr__(self):
        return self.name


def _replay(program, slots):
    """Drive a ring with ('g', name) gathers and ('f', name) frees; the decisions, and a check
    that no slot is handed to a gather while another owner holds it."""
    ring = GatherRing(_slots(64, slots))
    ring.log = []
    owners, held_by = {}, {}
    for op, name in program:
        o = owners.setdefault(name, _Owner(name))
        if op == "g":
            s = ring.acquire(o, 64)
            if s is not None:
                assert held_by.get(s) is None, f"slot {s} handed to {name} while {held_by[s]} holds it"
                held_by[s], o.slot = o, s
                assert ring.owner_at(ring.view(s, 16, torch.float32)[3:]) is o
        else:
            if o.slot is not None:
                ring.release(o, o.slot)
                held_by[o.slot], o.slot = None, None
    return ring.log, ring.spilled


def test_ring_bookkeeping():
    # forward of 4 blocks with one prefetched, the last kept for backward; backward with one
    # prefetched; then a recompute (activation checkpointing) holding a block through the next
    # gathers. R=2: 'a', held throughout, keeps slot 0: every gather numbered even spills.
    fwd = [("g", "b0"), ("g", "b1"), ("f", "b0"), ("g", "b2"), ("f", "b1"), ("g", "b3"), ("f", "b2")]
    bwd = [("g", "b2"), ("f", "b3"), ("g", "b1"), ("f", "b2"), ("g", "b0"), ("f", "b1"), ("f", "b0")]
    log, spilled = _replay(fwd + bwd, 3)
    assert log == [0, 1, 2, 0, 1, 2, 0] and spilled == 0
    held = [("g", "a"), ("g", "b0"), ("f", "b0"), ("g", "b1"), ("g", "b2"), ("f", "b1"), ("g", "b3"), ("f", "b2"),
            ("f", "b3"), ("f", "a")]
    log, spilled = _replay(held, 2)
    assert log == [0, 1, None, 1, None] and spilled == 2
    # More units in flight than slots: every gather past R spills until a slot is free again.
    burst = [("g", f"u{i}") for i in range(5)] + [("f", f"u{i}") for i in range(5)] + [("g", "u0"), ("g", "u1")]
    log, spilled = _replay(burst, 2)
    assert log == [0, 1, None, None, None, 1, 0] and spilled == 3
    # Two ranks, one program: the same decisions.
    assert _replay(held + burst, 3) == _replay(held + burst, 3)


def test_ring_refuses_what_does_not_fit():
    ring = GatherRing(_slots(64, 2))
    with pytest.raises(ValueError, match="a gather of 65 bytes does not fit a slot of 64"):
        ring.acquire(_Owner("x"), 65)
    with pytest.raises(ValueError, match="expected equal uint8 slots"):
        GatherRing([torch.zeros(4, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)])
    o, other = _Owner("o"), _Owner("other")
    s = ring.acquire(o, 8)
    with pytest.raises(RuntimeError, match="slot 0 is held by o, not by other"):
        ring.release(other, s)


# ----------------------------------------------------------------------------- stage 3 on gloo
def _force_ring(monkeypatch_slots):
    """Make stage 3 build its ring from ordinary tensors (gloo has no window), R slots."""
    import pynccl.zero.gather_ring as gather_ring
    from pynccl.comm.symmetric import SymmetricSupport
    gather_ring.GATHER_SLOTS = monkeypatch_slots
    gather_ring.symmetric_support = lambda group: SymmetricSupport(True, True, "")
    gather_ring.alloc_symmetric = lambda group, sizes: _slots(sizes[0][0], len(sizes))


def _run(kind, ring_slots, checkpointing, skips, optim, mixed, steps=3):
    """Losses, parameters and ring decisions of `steps` steps on this rank: _Branchy (5 blocks, 7
    units, no root) or a Hugging Face model (gradient checkpointing through HF's own switch; GPT-2's
    tied embedding makes a root unit, outside the ring)."""
    from test_zero_real_clients import _Branchy, batch, make_model
    import os
    os.environ["PYNCCL_ZERO3_SYMMETRIC"] = "1" if ring_slots else "0"
    if ring_slots:
        _force_ring(ring_slots)
    rank, ws = pynccl.get_rank(), pynccl.get_world_size()
    mp = pynccl.zero.MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
    branchy = kind.startswith("branchy")
    if kind == "branchy-blocks":     # 6 blocks, the only units (the embedding and head form the root)
        net, wrap = _Branchy(checkpointing, num_blocks=6), dict(wrap_modules=[nn.Sequential])
    else:
        net, wrap = (_Branchy(checkpointing, num_blocks=5) if branchy else make_model(kind, checkpointing)), {}
    model = pynccl.FullyShardedDataParallel(net, stage=3, mixed_precision=mp, **wrap)

    def forward(x, skip=()):
        return model(x, skip) if branchy else model(input_ids=x, labels=x).loss
    ring = model._runtime.gather_ring
    assert (ring is not None) == bool(ring_slots), model._runtime.gather_ring_reason
    if ring is not None:
        ring.log = []
    opt = (torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9) if optim == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(steps):
        x = batch(step)
        n = x.shape[0] // ws
        loss = forward(x[rank * n:(rank + 1) * n], skips(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    with torch.no_grad():                              # an evaluation forward gathers and frees too
        losses.append(forward(batch(steps)[rank * n:(rank + 1) * n]).detach())
    params = [t.clone() for t in model.full_state_dict().values()]
    if ring is not None:
        assert all(o is None for o in ring.occupants), ring.occupants      # every slot back after the step
    return losses, params, (ring.log if ring is not None else None)


def _ring_equals_plain(rank, ws, cases):
    out = []
    for kind, ring_slots, checkpointing, skip_name, optim, mixed in cases:
        skips = {"none": lambda step, r: (),
                 # a block left out on rank 1 only (its gathers and frees come at other times there)
                 "rank1": lambda step, r: (1,) if r == 1 and step == 1 else (),
                 # three blocks in a row left out on rank 1: there its backward gathers them at once, and
                 # must give their slots back before the gathers that follow (the runner has by then)
                 "rank1-run": lambda step, r: (1, 2, 3) if r == 1 and step == 1 else (),
                 # four in a row at either end: the walks end on them (post_root_forward, _end_of_backward)
                 "rank1-bottom4": lambda step, r: (0, 1, 2, 3) if r == 1 and step == 1 else (),
                 "rank1-top4": lambda step, r: (2, 3, 4, 5) if r == 1 and step == 1 else (),
                 # test_zero_gpu's conditional blocks: one rank, both ranks, the other rank; the last block too
                 "mixed": lambda step, r: [(1,) if r == 1 else (), (0, 2), (4,) if r == 0 else ()][step]}[skip_name]
        plain = _run(kind, 0, checkpointing, skips, optim, mixed)
        ringed = _run(kind, ring_slots, checkpointing, skips, optim, mixed)
        what = f"{kind} R={ring_slots} checkpointing={checkpointing} skip={skip_name} {optim} mixed={mixed}"
        for a, b in zip(plain[0], ringed[0]):
            assert torch.equal(a, b), f"{what}: losses {plain[0]} != {ringed[0]}"
        for a, b in zip(plain[1], ringed[1]):
            assert torch.equal(a, b), f"{what}: parameters differ"
        out.append(ringed[2])
    return out


# (model, slots, checkpointing (use_reentrant), skips, optimizer, bf16 compute)
CASES = [
    ("branchy", 4, None, "none", "sgd", False),
    ("branchy", 4, False, "none", "adamw", True),    # non-reentrant checkpointing
    ("branchy", 2, True, "none", "sgd", True),       # reentrant; 2 slots are enough for the normal flow
    ("branchy", 1, None, "none", "adamw", False),    # fewer slots than units in flight: every other gather spills
    ("branchy", 4, None, "rank1", "sgd", False),     # rank 1 skips a block: it frees and gathers at other times
    ("branchy", 2, False, "rank1", "adamw", True),
    ("branchy", 2, None, "mixed", "sgd", False),
    ("branchy", 3, None, "rank1-run", "sgd", False),   # the default R; found hanging on 2xH100 (session 10)
    ("branchy", 3, False, "rank1-run", "adamw", True),
    ("branchy-blocks", 3, None, "rank1-bottom4", "sgd", False),  # found in session 10's review
    ("branchy-blocks", 3, None, "rank1-top4", "sgd", False),
    ("branchy-blocks", 3, True, "rank1-top4", "sgd", False),     # reentrant: the last block kept alike (a hang before)
    ("branchy", 4, True, "mixed", "adamw", False),
    ("llama", 4, False, "none", "adamw", True),      # HF gradient checkpointing
    ("gpt2", 2, True, "none", "sgd", False),         # and a root unit (the tied embedding) beside the ring
]


def test_stage3_with_ring_equals_without():
    logs = run_multiprocess(_ring_equals_plain, 2, timeout=600, args=(CASES,))
    for case, log0, log1 in zip(CASES, logs[0], logs[1]):
        assert log0 == log1, f"{case}: the ranks decided differently"
        taken = sum(1 for s in log0 if s is not None and s >= 0)
        assert taken > 0, (case, log0)                # the ring was used
        if case[1] == 1:
            assert None in log0, (case, log0)         # and, with too few slots, refused
        else:
            assert None not in log0, (case, log0)     # enough slots: the normal flow never finds one taken


def _divergent_decisions(rank, ws):
    from test_zero_real_clients import _Branchy, batch
    _force_ring(4 if rank == 0 else 1)                 # rank 1's ring is too small: it spills where 0 does not
    model = pynccl.FullyShardedDataParallel(_Branchy(num_blocks=4), stage=3)
    with pytest.raises(CollectiveMismatchError, match="variant=ring.*variant=ordinary"):
        model(batch(0)[rank * 2:(rank + 1) * 2]).backward()
    return True


def test_check_collectives_names_a_divergent_decision():
    assert run_multiprocess(_divergent_decisions, 2, timeout=300, env={"PYNCCL_CHECK_COLLECTIVES": "1"}) == [True] * 2


def _memory_with_ring(rank, ws):
    """benchmarks/zero_memory.py's stage-3 measurement with the ring forced (4 slots), every
    reduce-scatter waited for as it starts (test_zero_memory's synchronous run)."""
    import test_zero_memory as tzm
    _force_ring(4)
    tzm.wait_each_reduce_scatter()
    bench = tzm._load_bench()
    return bench.measure(3, tzm.ARGS, torch.device("cpu"))


def test_memory_replay_counts_the_ring():
    """The ring replaces the gathered blocks by R slots held throughout: the replay
    (zero_memory.expected_peak(ring_slots=R)) matches the measured peak, and its gathered
    parameters are exactly the window plus the root, from the layouts."""
    for res in run_multiprocess(_memory_with_ring, 3, timeout=300):
        measured, expected = res["peak"]["total"], sum(res["expected"].values())
        assert 0.95 * expected <= measured <= 1.01 * expected, (measured, expected)
        assert res["peak"]["detail"]["params_full"] == res["expected"]["params_full"], (res["peak"], res["expected"])
    blocks, root = run_multiprocess(_block_and_root_numels, 3, timeout=120)[0]   # bf16: 2 bytes each
    slot = -(-2 * max(blocks) // ALIGN_BYTES) * ALIGN_BYTES
    assert res["expected"]["params_full"] == 4 * slot + 2 * root


def _block_and_root_numels(rank, ws):
    import test_zero_memory as tzm
    bench = tzm._load_bench()
    net, _ = bench.make_model(tzm.ARGS, torch.device("cpu"))
    model = pynccl.FullyShardedDataParallel(net, stage=3, bucket_cap_mb=tzm.ARGS.bucket_cap_mb,
                                            mixed_precision=pynccl.zero.MixedPrecision(torch.bfloat16, torch.bfloat16))
    rt = model._runtime
    return [u.layout.padded_numel for u in rt.forward_order], (rt.root.layout.padded_numel if rt.root else 0)


def _checked_skip(rank, ws):
    _run("branchy", 3, None, lambda step, r: (1,) if r == 1 and step == 1 else (), "sgd", False)
    return True


def test_check_collectives_with_a_skipped_block():
    """The signature check blocks the host before each collective until every rank has published;
    on the reduce-scatters' communicator a rank that skipped a block publishes only at the end of
    its backward, after gathers this rank would no longer start: the check must leave that
    communicator alone (its order is fixed by construction) or it hangs where it should help."""
    assert run_multiprocess(_checked_skip, 2, timeout=120, env={"PYNCCL_CHECK_COLLECTIVES": "1"}) == [True] * 2
