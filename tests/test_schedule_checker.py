"""The schedule checker, without processes: every rank's program (the lists the executor runs)
matches its messages, never deadlocks under blocking grouped p2p, and has the textbook bubble
(p - 1)/(v·m + p - 1) and memory (GPipe m, 1F1B min(p - rank, m) micro-batches)."""
import pytest

from pynccl.pipeline.actions import (Action, ActionType, PipelineLayout, ScheduleKind, build_programs,
                                     compute_order, format_program)
from pynccl.pipeline.schedule_checker import ScheduleError, check, expected_bubble, simulate

A = ActionType
COSTS = [(1.0, 2.0), (1.0, 1.0)]


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])
@pytest.mark.parametrize("costs", COSTS)
def test_bubble_matches_formula(kind, costs):
    for p in range(1, 9):
        for m in range(1, 17):
            res = check(kind, p, m, forward_cost=costs[0], backward_cost=costs[1])
            want = expected_bubble(p, m)
            for r in range(p):
                assert res.bubble[r] == pytest.approx(want, abs=1e-12), (kind, p, m, r)
            assert res.makespan == pytest.approx((m + p - 1) * sum(costs))


@pytest.mark.parametrize("costs", COSTS)
def test_interleaved_bubble_matches_formula(costs):
    for p in range(1, 7):
        for m in range(p, 4 * p + 1, p):
            for v in (2, 3, 4):
                res = check(ScheduleKind.INTERLEAVED_1F1B, p, m, v, *costs)
                want = expected_bubble(p, m, v)
                assert max(res.bubble.values()) == pytest.approx(want, abs=1e-12), (p, m, v)
                assert min(res.bubble.values()) == pytest.approx(want, abs=1e-12), (p, m, v)


def test_peak_live_activations():
    for p in range(1, 9):
        for m in range(1, 17):
            gpipe = check(ScheduleKind.GPIPE, p, m)
            one_f = check(ScheduleKind.ONE_F_ONE_B, p, m)
            for r in range(p):
                assert gpipe.peak_live[r] == m
                assert one_f.peak_live[r] == min(p - r, m) <= p


def test_orders():
    F = lambda j: Action(A.FORWARD, 1, j)   # noqa: E731
    B = lambda j: Action(A.BACKWARD, 1, j)  # noqa: E731
    # p=4, rank 1: warm-up of p - rank - 1 = 2 forwards, steady 1F1B, cool-down.
    assert compute_order(ScheduleKind.ONE_F_ONE_B, 1, 4, 5) == [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2),
                                                                B(3), B(4)]
    assert compute_order(ScheduleKind.ONE_F_ONE_B, 1, 4, 1) == [F(0), B(0)]
    assert compute_order(ScheduleKind.GPIPE, 1, 4, 3) == [F(0), F(1), F(2), B(0), B(1), B(2)]
    # Interleaved: stage k on rank k % p; each micro-batch visits every stage once each way.
    order = compute_order(ScheduleKind.INTERLEAVED_1F1B, 0, 2, 4, 3)
    assert sorted((a.type.value, a.stage, a.microbatch) for a in order) == sorted(
        (t, s, j) for t in "FB" for s in (0, 2, 4) for j in range(4))


def test_1f1b_steady_state_batches_both_directions():
    """Middle rank of p=3: after F, 'send activation to next + recv grad from next' is one
    batch; after B, 'send grad to previous + recv activation from previous' is one batch."""
    program = build_programs(ScheduleKind.ONE_F_ONE_B, 3, 4)[1]
    text = format_program(program)
    assert "[1SEND_F1 1RECV_B0] 1B0 [1SEND_B0 1RECV_F2] 1F2" in text, text
    batches = [i for i in program if not i[0].type.is_compute]
    # 16 messages (4 activations and 4 grads in, as many out) in 9 batches: 7 pairs, the first
    # receive and the last send; plus 2 metadata batches.
    assert sum(len(b) for b in batches) == 16 + 2
    assert len(batches) == 9 + 2


def test_metadata_precedes_first_transfer_only():
    for kind, v in ((ScheduleKind.GPIPE, 1), (ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.INTERLEAVED_1F1B, 2)):
        for rank, program in build_programs(kind, 3, 6, v).items():
            # Alone in its batch: the receiver may post a second recv after reading the header.
            assert all(len(i) == 1 for i in program if any(a.type in (A.SEND_META, A.RECV_META) for a in i))
            flat = [a for instr in program for a in instr]
            for t_meta, t_data in ((A.SEND_META, A.SEND_F), (A.RECV_META, A.RECV_F)):
                metas = [a for a in flat if a.type is t_meta]
                for meta in metas:
                    first_data = next(i for i, a in enumerate(flat) if a.type is t_data and a.stage == meta.stage)
                    assert flat.index(meta) < first_data
                assert len(metas) == len({a.stage for a in flat if a.type is t_data})


def test_p1_has_no_messages():
    for kind, v in ((ScheduleKind.GPIPE, 1), (ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.INTERLEAVED_1F1B, 3)):
        program = build_programs(kind, 1, 4, v)[0]
        assert all(i[0].type.is_compute and len(i) == 1 for i in program)


def test_checker_catches_deadlock_and_mismatch():
    layout = PipelineLayout(2)
    f0, f1 = Action(A.FORWARD, 0, 0), Action(A.FORWARD, 1, 0)
    b0, b1 = Action(A.BACKWARD, 0, 0), Action(A.BACKWARD, 1, 0)
    send_f, recv_f = Action(A.SEND_F, 0, 0), Action(A.RECV_F, 1, 0)
    send_b, recv_b = Action(A.SEND_B, 1, 0), Action(A.RECV_B, 0, 0)
    ok = {0: [(f0,), (send_f,), (recv_b,), (b0,)], 1: [(recv_f,), (f1,), (b1,), (send_b,)]}
    assert simulate(ok, layout).makespan == 6
    # Rank 0 waits for the gradient before sending the activation it needs: deadlock.
    bad = {0: [(f0,), (recv_b,), (send_f,), (b0,)], 1: ok[1]}
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad, layout)
    # Rank 0 sends micro-batch 1 first, rank 1 expects 0 first: wrong tensors, caught statically.
    s1, r1 = Action(A.SEND_F, 0, 1), Action(A.RECV_F, 1, 1)
    swapped = {0: [(s1,), (send_f,)], 1: [(recv_f,), (r1,)]}
    with pytest.raises(ScheduleError, match="sent as"):
        simulate(swapped, layout)
    with pytest.raises(ScheduleError, match="1 sends but 0 receives"):
        simulate({0: [(send_f,)], 1: []}, layout)


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        build_programs(ScheduleKind.INTERLEAVED_1F1B, 4, 6, 2)
    with pytest.raises(ValueError, match="n_microbatches must be a positive int"):
        build_programs(ScheduleKind.ONE_F_ONE_B, 2, 0)
    with pytest.raises(ValueError, match="one stage per rank"):
        build_programs(ScheduleKind.GPIPE, 2, 4, 2)
