"""Flight recorder of the gloo backend: the last N ops of a group (op, sequence number, dtype,
count, peer, state, enqueue time), kept in a ring and written as JSON when an op fails or times
out, so a hang post-mortem says which call each rank was in.

The NCCL backend keeps its ring in C++ (csrc/watchdog.cpp). The file written here has the C++
file's name pattern (pynccl_flight_<group>_rank<r>_pid<pid>.json in $PYNCCL_FLIGHT_RECORDER_DIR,
else the temp dir) and the same top-level keys (group, rank, world_size, device, reason,
nccl_version, seq, entries), so one reader serves both; gloo writes device -1 and nccl_version
null. Entries differ in two details: dtype is torch's name ("torch.float32", C++ writes c10's
"Float") and there is no async_op field.
"""
from __future__ import annotations

import collections
import json
import os
import re
import tempfile
import time
from typing import List, Optional

# The top-level keys of a flight record file, in the order both writers use.
FILE_KEYS = ("group", "rank", "world_size", "device", "reason", "nccl_version", "seq", "entries")
DEFAULT_CAPACITY = int(os.environ.get("PYNCCL_FLIGHT_RECORDER_SIZE", "64"))


def dump_dir() -> str:
    return os.environ.get("PYNCCL_FLIGHT_RECORDER_DIR") or tempfile.gettempdir()


def record_path(group_name: str, rank: int) -> str:
    """Where the record of this process's `rank` in `group_name` goes (the C++ writer's pattern)."""
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", group_name)
    return os.path.join(dump_dir(), f"pynccl_flight_{safe_name}_rank{rank}_pid{os.getpid()}.json")


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

    def dump(self, group_name: str, rank: int, world_size: int, seq: int, reason: str) -> str:
        """Write the ring as JSON and return the path, or, as the C++ writer does, a
        "(flight record not written: ...)" text: the error being reported matters more."""
        path = record_path(group_name, rank)
        record = dict(zip(FILE_KEYS, (group_name, rank, world_size, -1, reason, None, seq, self.entries())))
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:   # then renamed: a reader never sees half a file
                json.dump(record, f, indent=1)
            os.replace(tmp, path)
        except OSError as e:
            return f"(flight record not written: {path}: {e.strerror or e})"
        return path
