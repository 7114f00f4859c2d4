"""A process killed while writing a checkpoint leaves the previous one loadable."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from pynccl.checkpoint_io import atomic_save, load


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_save({"step": 1, "w": torch.arange(4.0)}, path)
    script = textwrap.dedent(f"""
        import sys, time, torch
        from pynccl.checkpoint_io import atomic_save

        class Slow:
            # Pickling blocks half-way through the write, so the kill lands mid-save.
            def __reduce__(self):
                print("writing", flush=True)
                time.sleep(60)
                return (int, (0,))

        atomic_save({{"step": 2, "big": torch.zeros(1 << 20), "slow": Slow()}}, {str(path)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    ckpt = load(path)
    assert ckpt["step"] == 1 and torch.equal(ckpt["w"], torch.arange(4.0))
    # A later save still works and replaces it.
    atomic_save({"step": 3}, path)
    assert load(path)["step"] == 3
    leftovers = [p for p in os.listdir(tmp_path) if p != "ckpt.pt"]
    assert all(".tmp." in p for p in leftovers)
