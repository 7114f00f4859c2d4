"""Run an example's training function in a pynccl process group: the one torchrun set up
(RANK, WORLD_SIZE, ... in the environment), or a world of one for a plain `python script.py`.
NCCL when a GPU is present (one per local rank), gloo otherwise."""
from __future__ import annotations

import os

import torch

import pynccl


def run_in_process_group(fn, *args):
    if "RANK" not in os.environ:  # plain `python script.py`: a world of one
        from pynccl.testing import find_free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(find_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    pynccl.init_process_group(backend=backend)
    try:
        return fn(*args)
    finally:
        pynccl.destroy_process_group()
