"""A fresh key space in torchrun's agent store for each attempt of an elastic job.

With the c10d rendezvous torchrun's agent hosts the workers' store (TORCHELASTIC_USE_AGENT_STORE=True)
and keeps it when it restarts them (--max-restarts): the last attempt's keys are still there, and
a restarted rank would find its own rank already claimed, or read a dead peer's address. The
attempt cannot be told from TORCHELASTIC_RESTART_COUNT: an agent whose workers restart because
another node failed keeps its count (torch issue #135712; seen here on torch 2.14: counts 0 and 1
in one attempt). So the ranks of one attempt agree on a key space of their own:

  * rank 0 (always a fresh process) publishes a new nonce under CURRENT_KEY;
  * every other rank claims its slot under the nonce it reads there; a slot already taken means
    the nonce is a past attempt's (this rank held it then), so it waits for CURRENT_KEY to change;
  * rank 0 seals its nonce with the world size once every rank has claimed a slot; a rank goes on
    only under a nonce sealed for its own world size, and moves over whenever CURRENT_KEY changes.
"""
from __future__ import annotations

import time
import uuid

import torch.distributed as tdist

from ..errors import CommTimeoutError

CURRENT_KEY = "pynccl/elastic/current"
POLL_S = 0.02


def _key(nonce: str, what: str) -> str:
    return f"pynccl/elastic/{nonce}/{what}"


def _read(store, key: str):
    return store.get(key).decode() if store.check([key]) else None


def fresh_key_space(store, rank: int, world_size: int, timeout_s: float):
    """A PrefixStore over `store` that only this attempt's ranks use. Collective over the world."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        nonce = uuid.uuid4().hex
        store.set(CURRENT_KEY, nonce)
        store.add(_key(nonce, "rank0"), 1)
        store.add(_key(nonce, "joined"), 1)
        while store.add(_key(nonce, "joined"), 0) < world_size:
            _check_deadline(deadline, rank, world_size, timeout_s)
            time.sleep(POLL_S)
        store.set(_key(nonce, "sealed"), str(world_size))
        return tdist.PrefixStore(f"pynccl/elastic/{nonce}", store)
    nonce, joined = None, False
    while True:
        current = _read(store, CURRENT_KEY)
        if current is not None and current != nonce:
            nonce = current
            # NOTE: the slot is claimed once per nonce; a taken slot is a past attempt's claim.
            joined = store.add(_key(nonce, f"rank{rank}"), 1) == 1
            if joined:
                store.add(_key(nonce, "joined"), 1)
        if joined and _read(store, _key(nonce, "sealed")) == str(world_size):
            return tdist.PrefixStore(f"pynccl/elastic/{nonce}", store)
        _check_deadline(deadline, rank, world_size, timeout_s)
        time.sleep(POLL_S)


def _check_deadline(deadline: float, rank: int, world_size: int, timeout_s: float) -> None:
    if time.monotonic() > deadline:
        raise CommTimeoutError(
            f"init_process_group: rank {rank} waited {timeout_s:.0f}s for the {world_size} ranks of this torchrun "
            f"attempt to meet in the agent's store (TORCHELASTIC_USE_AGENT_STORE=True); rank 0 "
            f"{'saw too few ranks arrive' if rank == 0 else 'never opened this attempt (is it alive?)'}")
