"""monitored_barrier: a barrier bounded by a timeout that names the ranks that did not arrive.

torch's runs on gloo only (rank 0 exchanges messages with every rank). This one goes through the
rendezvous store, so it is the same on both backends and needs no communicator: each rank
announces itself under the call's key; the group's first rank waits for all of them until the
timeout, then publishes the verdict, which the others wait for. A missing rank is named on every
rank that is still there, by global rank (torch names it on rank 0 only).
"""
from __future__ import annotations

import time

from ..errors import CommTimeoutError
from .groups import _require_usable, _state, _timeout_seconds, resolve_group
from .membership import is_non_member, warn_not_in_group


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """Blocks until every rank of `group` calls it, at most `timeout` (seconds or a timedelta;
    default: the group's). Raises CommTimeoutError naming the first rank that did not arrive
    (every missing rank with wait_all_ranks=True). Host-side only: it orders no device work."""
    if is_non_member(group):
        return warn_not_in_group("monitored_barrier")
    g = _require_usable(resolve_group(group))
    timeout_s = _timeout_seconds(timeout) if timeout is not None else g.timeout_s
    g._monitored_calls = seq = getattr(g, "_monitored_calls", 0) + 1
    store = _state.store
    key = f"{_state.key_prefix}/monitored_barrier/{g.name}/{seq}"
    store.set(f"{key}/rank{g.group_rank}", "1")
    if g.group_rank == 0:
        arrived = [f"{key}/rank{r}" for r in range(g.world_size)]
        deadline = time.monotonic() + timeout_s
        missing = []
        while True:
            missing = [g.ranks[r] for r in range(g.world_size) if not store.check([arrived[r]])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        store.set(f"{key}/verdict", ",".join(map(str, missing)))
        if seq > 1:   # everyone has read the previous call's verdict: they all arrived here
            store.delete_key(f"{_state.key_prefix}/monitored_barrier/{g.name}/{seq - 1}/verdict")
        for r in range(g.world_size):
            store.delete_key(arrived[r])
    else:
        deadline = time.monotonic() + timeout_s + 1.0   # NOTE: rank 0 decides; give it its full timeout
        while not store.check([f"{key}/verdict"]):
            if time.monotonic() >= deadline:
                raise CommTimeoutError(f"monitored_barrier on group '{g.name}': global rank {g.ranks[0]} (the "
                                       f"group's first rank, which monitors it) did not answer within "
                                       f"{timeout_s:.1f}s")
            time.sleep(0.005)
        verdict = store.get(f"{key}/verdict").decode()
        missing = [int(r) for r in verdict.split(",")] if verdict else []
    if missing:
        shown = missing if wait_all_ranks else missing[:1]
        which = "Ranks " + ", ".join(map(str, shown)) if len(shown) > 1 else f"Rank {shown[0]}"
        raise CommTimeoutError(f"monitored_barrier on group '{g.name}': {which} failed to pass monitoredBarrier "
                               f"in {timeout_s * 1000:.0f} ms (global ranks)")
