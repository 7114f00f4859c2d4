"""Prove a schedule right without processes: simulate every rank's program (the lists the executor
runs, from actions.build_programs) under the strictest semantics of grouped p2p, and time it.

Model (conservative, so a schedule it accepts also runs under NCCL's looser reality):
* A rank runs its instructions in order. A compute action takes its cost in time.
* A batch of sends/recvs is posted when the rank reaches it and the rank blocks until every op in
  it has completed. An op completes only when its peer has posted the matching op (rendezvous:
  no buffering, sends block too). Ops match in order per directed rank pair, as NCCL matches
  them; the k-th message on a pair must be the same logical message on both sides, or the
  tensors would be exchanged with the wrong micro-batch.
* No rank can move and one has not finished: deadlock, reported with what each rank waits on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .actions import Action, ActionType, Instruction, PipelineLayout, ScheduleKind, build_programs


class ScheduleError(AssertionError):
    """A schedule that mismatches messages or deadlocks."""


@dataclass
class SimResult:
    makespan: float
    busy: Dict[int, float]                  # compute time per rank
    bubble: Dict[int, float]                # 1 - busy / makespan, per rank
    peak_live: Dict[int, int]               # most micro-batch activations held at once, per rank
    finish: Dict[int, float] = field(default_factory=dict)

    @property
    def max_bubble(self) -> float:
        return max(self.bubble.values())


def expected_bubble(pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """(p - 1) / (v·m + p - 1): GPipe and 1F1B (v = 1) and interleaved 1F1B with equal stage costs."""
    return (pp_size - 1) / (stages_per_rank * n_microbatches + pp_size - 1)


def _channel_queues(programs: Dict[int, List[Instruction]], layout: PipelineLayout):
    """Per directed pair (src, dst): the messages in the order src sends them and in the order dst
    posts its receives. Checks they name the same logical messages."""
    sends: Dict[Tuple[int, int], List[Action]] = {}
    recvs: Dict[Tuple[int, int], List[Action]] = {}
    for rank, program in programs.items():
        for instr in program:
            for a in instr:
                if a.type.is_compute:
                    continue
                peer = layout.rank_of(a.peer_stage())
                if a.type.is_send:
                    sends.setdefault((rank, peer), []).append(a)
                else:
                    recvs.setdefault((peer, rank), []).append(a)
    for pair in set(sends) | set(recvs):
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if len(s) != len(r):
            raise ScheduleError(f"ranks {pair[0]}->{pair[1]}: {len(s)} sends but {len(r)} receives")
        for i, (a, b) in enumerate(zip(s, r)):
            if a.counterpart() != b:
                raise ScheduleError(f"ranks {pair[0]}->{pair[1]}: message {i} is sent as {a!r} but "
                                    f"received as {b!r} (expected {a.counterpart()!r})")
    return sends, recvs


def simulate(programs: Dict[int, List[Instruction]], layout: PipelineLayout,
             forward_cost: float = 1.0, backward_cost: float = 2.0) -> SimResult:
    _channel_queues(programs, layout)
    ranks = sorted(programs)
    pc = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    busy = {r: 0.0 for r in ranks}
    live = {r: 0 for r in ranks}
    peak = {r: 0 for r in ranks}
    matched: Dict[Tuple[int, Action], float] = {}   # op -> time it completed

    def current(r) -> Optional[Instruction]:
        return programs[r][pc[r]] if pc[r] < len(programs[r]) else None

    progress = True
    while progress:
        progress = False
        for r in ranks:
            while (instr := current(r)) is not None:
                if instr[0].type.is_compute:
                    a = instr[0]
                    forward = a.type is ActionType.FORWARD
                    cost = forward_cost if forward else backward_cost
                    clock[r] += cost
                    busy[r] += cost
                    live[r] += 1 if forward else -1
                    peak[r] = max(peak[r], live[r])
                    pc[r] += 1
                    progress = True
                    continue
                # A posted batch: match each op whose peer has posted its counterpart right now.
                for a in instr:
                    if (r, a) in matched:
                        continue
                    peer = layout.rank_of(a.peer_stage())
                    peer_instr = current(peer)
                    if peer_instr is not None and a.counterpart() in peer_instr:
                        t = max(clock[r], clock[peer])
                        matched[(r, a)] = t
                        matched[(peer, a.counterpart())] = t
                if all((r, a) in matched for a in instr):
                    clock[r] = max([clock[r]] + [matched[(r, a)] for a in instr])
                    pc[r] += 1
                    progress = True
                    continue
                break
    stuck = {r: current(r) for r in ranks if current(r) is not None}
    if stuck:
        lines = [f"rank {r} waits at instruction {pc[r]}: {list(i)}" for r, i in stuck.items()]
        raise ScheduleError("deadlock:\n" + "\n".join(lines))
    makespan = max(clock.values())
    bubble = {r: 1.0 - busy[r] / makespan for r in ranks}
    return SimResult(makespan, busy, bubble, peak, dict(clock))


def check(kind: ScheduleKind, pp_size: int, n_microbatches: int, stages_per_rank: int = 1,
          forward_cost: float = 1.0, backward_cost: float = 2.0, forward_only: bool = False) -> SimResult:
    """Generate every rank's program for this schedule (its eval()'s with forward_only) and simulate
    it (raises ScheduleError)."""
    programs = build_programs(kind, pp_size, n_microbatches, stages_per_rank, forward_only)
    return simulate(programs, PipelineLayout(pp_size, stages_per_rank), forward_cost, backward_cost)


def report(kind: ScheduleKind, pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> str:
    res = check(kind, pp_size, n_microbatches, stages_per_rank)
    exp = expected_bubble(pp_size, n_microbatches, stages_per_rank)
    return (f"{kind.value} p={pp_size} m={n_microbatches} v={stages_per_rank}: no deadlock, "
            f"makespan {res.makespan:g}, bubble {res.max_bubble:.4f} (formula {exp:.4f}), "
            f"peak live activations per rank {[res.peak_live[r] for r in sorted(res.peak_live)]}")


if __name__ == "__main__":
    import sys
    p, m = (int(x) for x in sys.argv[1:3]) if len(sys.argv) >= 3 else (4, 8)
    for k in ScheduleKind:
        v = 2 if k is ScheduleKind.INTERLEAVED_1F1B else 1
        if k is ScheduleKind.INTERLEAVED_1F1B and m % p:
            continue
        print(report(k, p, m, v))
