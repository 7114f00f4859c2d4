"""Run an example's training function in a pynccl process group: the one torchrun set up
(RANK, WORLD_SIZE, ... in the environment), or a world of one for a plain `python script.py`.
NCCL where each local rank has a GPU of its own and pynccl._C is built, gloo otherwise (so
`torchrun --nproc_per_node 2` on a one-GPU machine runs on CPU rather than failing)."""
from __future__ import annotations

import os

import torch

import pynccl


def backend() -> str:
    """"nccl" where each of this host's LOCAL_WORLD_SIZE ranks has a GPU and pynccl._C is built."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return "nccl" if pynccl.is_nccl_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def run_in_process_group(fn, *args):
    if "RANK" not in os.environ:  # plain `python script.py`: a world of one
        from pynccl.testing import find_free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(find_free_port()))
    name = backend()
    if name == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    pynccl.init_process_group(backend=name)
    try:
        return fn(*args)
    finally:
        pynccl.destroy_process_group()
