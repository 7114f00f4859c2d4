"""Flight recorder: the last N collectives of a group (op, sequence number, dtype, count,
peer, state, enqueue time), kept in a ring and written as JSON when an op fails or times out,
so a hang post-mortem says which call each rank was in. The NCCL backend keeps the same
records in C++ (csrc/), this one serves the gloo backend; both return the same dict fields.
"""
from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from typing import List, Optional

DEFAULT_CAPACITY = int(os.environ.get("PYNCCL_FLIGHT_RECORDER_SIZE", "64"))


def dump_dir() -> str:
    return os.environ.get("PYNCCL_FLIGHT_RECORDER_DIR") or tempfile.gettempdir()


class FlightRecorder:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._ring = collections.deque(maxlen=max(1, capacity))

    def record(self, op: str, seq: int, dtype: Optional[str], count: int, peer: int) -> dict:
        entry = {"op": op, "seq": seq, "dtype": dtype, "count": count, "peer": peer,
                 "state": "enqueued", "enqueue_time_us": int(time.time() * 1e6)}
        self._ring.append(entry)
        return entry

    def entries(self) -> List[dict]:
        return [dict(e) for e in self._ring]

    def dump(self, group_name: str, rank: int, reason: str) -> str:
        """Write the ring as JSON; returns the path (atomic: a reader never sees half a file)."""
        path = os.path.join(dump_dir(), f"pynccl_flight_{group_name}_rank{rank}_{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"group": group_name, "rank": rank, "reason": reason, "entries": self.entries()}, f, indent=1)
        os.replace(tmp, path)
        return path
