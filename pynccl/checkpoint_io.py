"""Crash-safe checkpoint files: write to a temporary file in the same folder, fsync, then
rename over the old one. A process killed mid-save leaves the previous checkpoint intact
(rename is atomic within a file system), so a run can always resume from the last one."""
from __future__ import annotations

import os

import torch


def atomic_save(obj, path: str) -> None:
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    # NOTE: fsync the folder too, or the rename itself may not survive a power loss.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str, map_location="cpu"):
    """torch.load with weights_only=False (our checkpoints hold optimizer state and metadata)."""
    return torch.load(os.fspath(path), map_location=map_location, weights_only=False)
