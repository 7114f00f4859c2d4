"""torch groups made by their members alone (`torch.distributed.new_group(ranks,
use_local_synchronization=True)`), named alike on every member.

torch names such a group by hashing its ranks with a salt each rank keeps for itself: in torch 2.11
the number of groups that rank belongs to (`len(_world.pg_names)`); in torch 2.14 its count of
group creations, which a members-only group advances on its members alone. Either salt differs
between two members once one of them has been in a group the other was not in (`new_group([0])` in
a 2-rank job; a members-only group over a subgroup). The members then look for each other under
different store prefixes and gloo's connect waits out the group's time-out (torch 2.11: ZeRO-3's
duplicate group after train_bench --floor's `new_group([0])` hung in `ProcessGroupGloo`).

Here the members name the group themselves, from what every member computes alike: a `base` the
caller gives (the parent group's name and the purpose) and a generation from the default store.
Each member adds 1 to a counter under `base`; every member of one generation adds before any of
them can finish making the group (making it waits for all of them), so `(count - 1) // size` is the
same on each. torch's `_process_group_name` gives that name for the one call, under a lock; torch's
own counters are left as they are, so later groups torch names are unaffected.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Sequence

import torch.distributed as tdist

_COUNTERS = "pynccl/members_only"
_naming = threading.Lock()


@contextlib.contextmanager
def _named(name: str):
    c10d = tdist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is None:            # a torch without the hook names the group itself
        yield
        return
    c10d._process_group_name = lambda ranks, use_hashed_name: name
    try:
        yield
    finally:
        c10d._process_group_name = original


def group_name(base: str, size: int) -> str:
    """The next name of a members-only group under `base` of `size` members (collective over them:
    each member calls it once per group)."""
    store = tdist.distributed_c10d._get_default_store()
    generation = (store.add(f"{_COUNTERS}/{base}", 1) - 1) // size
    return f"pynccl:{base}:{generation}"


def new_members_only_group(ranks: Sequence[int], backend: str, timeout_s: float, base: str):
    """torch's `new_group(ranks, backend, timeout, use_local_synchronization=True)`, called by the
    members of `ranks` only, with a name every member gives it (see the module's docstring)."""
    ranks = sorted(ranks)
    name = group_name(base, len(ranks))
    with _naming, _named(name):
        return tdist.new_group(ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
