"""One rank's whole run: join the group, set up the implementations and the side channel, run
every requested op, and say (as the exit status) whether any result was wrong."""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as tdist

import pynccl

from .harness import Context, OpFailed, run_op
from .impl import make_impls
from .ops import get_op
from .report import Reporter


def device_line(rank: int, device: torch.device) -> str:
    """nccl-tests' '#  Rank  0 Group  0 Pid  12345 on   hostname device  0 [0000:18:00] NVIDIA H200'."""
    host = socket.gethostname()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return "#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s" % (
            rank, 0, os.getpid(), host, device.index, getattr(p, "pci_domain_id", 0), getattr(p, "pci_bus_id", 0),
            getattr(p, "pci_device_id", 0), p.name)
    return "#  Rank %2d Group %2d Pid %6d on %10s device %2d [cpu] CPU, %d torch thread(s)" % (
        rank, 0, os.getpid(), host, -1, torch.get_num_threads())


def run_worker(opts, backend: str) -> int:
    """0: every check passed; 1: wrong results or an op that could not run (reported on stderr)."""
    rank = os.environ.get("RANK", "?")
    try:
        owns = not pynccl.is_initialized()
        if owns:
            pynccl.init_process_group(backend=backend, timeout=opts.timeout)
        try:
            return run_initialized(opts, backend)
        finally:
            if owns:
                pynccl.destroy_process_group()
    except (ValueError, TypeError, RuntimeError, ImportError) as e:
        print(f"pynccl.bench: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 1


def run_initialized(opts, backend: str) -> int:
    rank, nranks = pynccl.get_rank(), pynccl.get_world_size()
    device = pynccl.get_device()
    timeout = datetime.timedelta(seconds=opts.timeout)
    # NOTE: collective, same order on every rank: the side channel, then torch's group if any.
    side_group = tdist.new_group(backend="gloo", timeout=timeout)
    impls = make_impls(opts.impl, device, opts.timeout)
    lines = [None] * nranks
    tdist.all_gather_object(lines, device_line(rank, device), group=side_group)
    ctx = Context(rank=rank, nranks=nranks, device=device, impls=impls, side_group=side_group, opts=opts)
    failed = 0
    for name in opts.ops:
        op = get_op(name)
        ctx.disabled.clear()
        reporter = Reporter(op, ctx, lines, backend)
        reporter.header()
        try:
            run_op(op, ctx, reporter)
        except OpFailed as e:
            reporter.note(f"{op.perf_name} stopped: {e}")
            if rank == 0:
                print(f"pynccl.bench: {op.name}: error: {e}", file=sys.stderr, flush=True)
            failed += 1
        failed += reporter.finish()
        if rank == 0 and len(opts.ops) > 1:
            print(flush=True)
    ctx.sync()
    tdist.barrier(group=side_group)
    return 1 if failed else 0
