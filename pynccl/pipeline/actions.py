"""Pipeline schedules as data: for each pipeline rank, the ordered list of instructions it runs
(one compute action, or one batch of sends/recvs that becomes one grouped batch_isend_irecv).

This is the single source of truth: schedules.py executes these lists, schedule_checker.py
simulates the very same lists (matching, deadlock freedom, bubble). Pure Python, no torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


class ActionType(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"        # stage's output activation -> next stage
    RECV_F = "RECV_F"        # stage's input activation <- previous stage
    SEND_B = "SEND_B"        # grad of stage's input -> previous stage
    RECV_B = "RECV_B"        # grad of stage's output <- next stage
    SEND_META = "SEND_META"  # once per step, before the first SEND_F: "shapes unchanged" or the new shapes
    RECV_META = "RECV_META"  # its counterpart, before the first RECV_F

    @property
    def is_compute(self) -> bool:
        return self in (ActionType.FORWARD, ActionType.BACKWARD)

    @property
    def is_send(self) -> bool:
        return self in (ActionType.SEND_F, ActionType.SEND_B, ActionType.SEND_META)


# Stage offset of the peer, and the action the peer runs to match this one.
_PEER = {
    ActionType.SEND_F: (+1, ActionType.RECV_F), ActionType.RECV_F: (-1, ActionType.SEND_F),
    ActionType.SEND_B: (-1, ActionType.RECV_B), ActionType.RECV_B: (+1, ActionType.SEND_B),
    ActionType.SEND_META: (+1, ActionType.RECV_META), ActionType.RECV_META: (-1, ActionType.SEND_META),
}


@dataclass(frozen=True)
class Action:
    type: ActionType
    stage: int        # the stage that runs it (global stage index)
    microbatch: int

    def peer_stage(self) -> int:
        return self.stage + _PEER[self.type][0]

    def counterpart(self) -> "Action":
        """The action the peer stage runs to match this send/recv."""
        offset, peer_type = _PEER[self.type]
        return Action(peer_type, self.stage + offset, self.microbatch)

    def __repr__(self):
        return f"{self.stage}{self.type.value}{self.microbatch}"


Instruction = Tuple[Action, ...]   # (compute,) or a batch of comm actions run as one NCCL group


class ScheduleKind(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


@dataclass(frozen=True)
class PipelineLayout:
    """num_stages = pp_size × stages_per_rank; stage k lives on pp rank k % pp_size (looping
    placement, as Megatron and torch's interleaved schedule), so rank r holds r, r+p, r+2p, ..."""
    pp_size: int
    stages_per_rank: int = 1

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        return stage % self.pp_size

    def stages_of(self, pp_rank: int) -> List[int]:
        return [pp_rank + c * self.pp_size for c in range(self.stages_per_rank)]

    def is_remote(self, stage: int, other: int) -> bool:
        return self.rank_of(stage) != self.rank_of(other)


# ----------------------------------------------------------------------------- compute orders
def _fwd(stage, mb):
    return Action(ActionType.FORWARD, stage, mb)


def _bwd(stage, mb):
    return Action(ActionType.BACKWARD, stage, mb)


def gpipe_order(pp_rank: int, pp_size: int, n_microbatches: int) -> List[Action]:
    """All forwards, then all backwards in micro-batch order (arXiv:1811.06965)."""
    m = n_microbatches
    return [_fwd(pp_rank, j) for j in range(m)] + [_bwd(pp_rank, j) for j in range(m)]


def one_f_one_b_order(pp_rank: int, pp_size: int, n_microbatches: int) -> List[Action]:
    """PipeDream-Flush 1F1B (arXiv:2006.09503): min(p - rank - 1, m) warm-up forwards, then
    alternate one forward and one backward, then the remaining backwards. A rank holds at most
    min(p - rank, m) micro-batches' activations."""
    m = n_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    order = [_fwd(pp_rank, j) for j in range(warmup)]
    for i in range(m - warmup):
        order += [_fwd(pp_rank, warmup + i), _bwd(pp_rank, i)]
    order += [_bwd(pp_rank, j) for j in range(m - warmup, m)]
    return order


def _interleaved_warmup(pp_rank: int, p: int, m: int, v: int) -> int:
    if m == p:
        return m * v   # as Megatron: a single round, so all forwards then all backwards
    return min((p - pp_rank - 1) * 2 + (v - 1) * p, m * v)


def interleaved_order(pp_rank: int, pp_size: int, n_microbatches: int, stages_per_rank: int) -> List[Action]:
    """Megatron's interleaved 1F1B (arXiv:2104.04473 §2.2): micro-batches go through this rank's
    v stages in rounds of p; warm-up (p - rank - 1)·2 + (v - 1)·p forwards, then 1F1B; with a
    single round (m = p) every forward comes first, as Megatron does."""
    p, v, m = pp_size, stages_per_rank, n_microbatches
    total = m * v

    def unit(k: int, forward: bool) -> Tuple[int, int]:
        chunk = (k % (p * v)) // p
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return pp_rank + chunk * p, mb

    warmup = _interleaved_warmup(pp_rank, p, m, v)
    order = [_fwd(*unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [_fwd(*unit(warmup + k, True)), _bwd(*unit(k, False))]
    order += [_bwd(*unit(k, False)) for k in range(total - warmup, total)]
    return order


def check_schedule_args(kind: ScheduleKind, pp_size: int, n_microbatches: int, stages_per_rank: int = 1) -> None:
    for name, value in (("pp_size", pp_size), ("n_microbatches", n_microbatches),
                        ("stages_per_rank", stages_per_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{kind.value} schedule: {name} must be a positive int, got {value!r}")
    if kind is ScheduleKind.INTERLEAVED_1F1B:
        if n_microbatches % pp_size:
            raise ValueError(f"interleaved 1F1B: n_microbatches ({n_microbatches}) must be a multiple of "
                             f"the pipeline size ({pp_size}); micro-batches move through a rank's stages "
                             f"in rounds of pp_size")
    elif stages_per_rank != 1:
        raise ValueError(f"{kind.value} schedule: one stage per rank expected, got stages_per_rank="
                         f"{stages_per_rank}; use ScheduleInterleaved1F1B for several")


def compute_order(kind: ScheduleKind, pp_rank: int, pp_size: int, n_microbatches: int,
                  stages_per_rank: int = 1) -> List[Action]:
    check_schedule_args(kind, pp_size, n_microbatches, stages_per_rank)
    if kind is ScheduleKind.GPIPE:
        return gpipe_order(pp_rank, pp_size, n_microbatches)
    if kind is ScheduleKind.ONE_F_ONE_B:
        return one_f_one_b_order(pp_rank, pp_size, n_microbatches)
    return interleaved_order(pp_rank, pp_size, n_microbatches, stages_per_rank)


# ----------------------------------------------------------------------------- lowering to p2p
def lower(order: List[Action], layout: PipelineLayout, sync_after: Optional[List[bool]] = None) -> List[Instruction]:
    """Insert the sends/recvs a compute order needs and group them into batches.

    Batches sit at sync points: before the first compute and after each compute c with
    sync_after[c] (default: every compute). A batch holds the sends produced since the previous
    sync point and the recvs of the computes up to the next one. With every compute a sync point,
    a recv lands right before its consumer and a send right after its producer, so the 1F1B steady
    state runs "send activation to next + recv grad from next" and "send grad to previous + recv
    activation from previous" as one batch each. Interleaved 1F1B syncs only after the backward of
    each steady-state (F, B) pair, giving Megatron's one four-way batch per pair, which keeps
    neighbours in lock-step around the ring of ranks. Hand-offs between stages on one rank need
    no message. The first SEND_F/RECV_F of each stage in a step is preceded by a batch with its
    SEND_META/RECV_META alone (NOTE: inserting a matched pair right before the batches holding
    the matched data messages cannot create a deadlock).
    """
    if sync_after is None:
        sync_after = [True] * len(order)
    last_stage = layout.num_stages - 1
    program: List[Instruction] = []
    meta_sent, meta_received = set(), set()

    def recvs_of(a: Action) -> List[Action]:
        k, j = a.stage, a.microbatch
        if a.type is ActionType.FORWARD and k > 0 and layout.is_remote(k, k - 1):
            return [Action(ActionType.RECV_F, k, j)]
        if a.type is ActionType.BACKWARD and k < last_stage and layout.is_remote(k, k + 1):
            return [Action(ActionType.RECV_B, k, j)]
        return []

    def sends_of(a: Action) -> List[Action]:
        k, j = a.stage, a.microbatch
        if a.type is ActionType.FORWARD and k < last_stage and layout.is_remote(k, k + 1):
            return [Action(ActionType.SEND_F, k, j)]
        if a.type is ActionType.BACKWARD and k > 0 and layout.is_remote(k, k - 1):
            return [Action(ActionType.SEND_B, k, j)]
        return []

    def emit(batch: List[Action]):
        meta = []
        for a in batch:
            if a.type is ActionType.SEND_F and a.stage not in meta_sent:
                meta_sent.add(a.stage)
                meta.append(Action(ActionType.SEND_META, a.stage, a.microbatch))
            elif a.type is ActionType.RECV_F and a.stage not in meta_received:
                meta_received.add(a.stage)
                meta.append(Action(ActionType.RECV_META, a.stage, a.microbatch))
        # NOTE: one meta action per batch: a receiver reads the header on the host and may then
        # post a second recv (the shapes), which must depend on nothing but its one sender.
        program.extend((a,) for a in meta)
        if batch:
            program.append(tuple(batch))

    def recvs_until_sync(start: int) -> List[Action]:
        out = []
        for i in range(start, len(order)):
            out += recvs_of(order[i])
            if sync_after[i]:
                break
        return out

    for a in order:
        if not a.type.is_compute:
            raise ValueError(f"lower: expected FORWARD/BACKWARD actions only, got {a!r}")
    emit(recvs_until_sync(0))
    sends: List[Action] = []
    for i, a in enumerate(order):
        program.append((a,))
        sends += sends_of(a)
        if sync_after[i] or i == len(order) - 1:
            emit(sends + recvs_until_sync(i + 1))
            sends = []
    return program


def sync_points(kind: ScheduleKind, pp_rank: int, pp_size: int, n_microbatches: int,
                stages_per_rank: int = 1) -> List[bool]:
    """Where each schedule puts its batches (see lower): after every compute, except, in
    interleaved 1F1B, between the forward and the backward of a steady-state pair."""
    order = compute_order(kind, pp_rank, pp_size, n_microbatches, stages_per_rank)
    sync = [True] * len(order)
    if kind is ScheduleKind.INTERLEAVED_1F1B:
        warmup = _interleaved_warmup(pp_rank, pp_size, n_microbatches, stages_per_rank)
        total = n_microbatches * stages_per_rank
        for k in range(total - warmup):
            sync[warmup + 2 * k] = False   # the F of the k-th (F, B) pair
    return sync


def build_program(kind: ScheduleKind, pp_rank: int, pp_size: int, n_microbatches: int, stages_per_rank: int = 1,
                  forward_only: bool = False) -> List[Instruction]:
    """What the executor runs on pp rank pp_rank. forward_only (eval(), or no loss_fn): the same
    forwards in the same order, no backwards, a batch after every forward."""
    layout = PipelineLayout(pp_size, stages_per_rank)
    order = compute_order(kind, pp_rank, pp_size, n_microbatches, stages_per_rank)
    if forward_only:
        return lower([a for a in order if a.type is ActionType.FORWARD], layout)
    return lower(order, layout, sync_points(kind, pp_rank, pp_size, n_microbatches, stages_per_rank))


def build_programs(kind: ScheduleKind, pp_size: int, n_microbatches: int, stages_per_rank: int = 1,
                   forward_only: bool = False) -> Dict[int, List[Instruction]]:
    """Every pp rank's program (what the executor runs on that rank)."""
    return {r: build_program(kind, r, pp_size, n_microbatches, stages_per_rank, forward_only) for r in range(pp_size)}


def format_program(program: List[Instruction]) -> str:
    """One line, e.g. `0F0 [0SEND_META0] [0SEND_F0] 0F1 [0SEND_F1 0RECV_B0] 0B0 ...`."""
    parts = []
    for instr in program:
        if len(instr) == 1 and instr[0].type.is_compute:
            parts.append(repr(instr[0]))
        else:
            parts.append("[" + " ".join(repr(a) for a in instr) + "]")
    return " ".join(parts)
