"""Starting the ranks: --nproc N processes of our own, torchrun's (RANK/WORLD_SIZE set), one, or
--nnodes N torchrun agents on this host (--nproc ranks each) talking over sockets.

--nproc forks on gloo (torch is already imported: much faster) and spawns on nccl (CUDA must not
be initialised before a fork). The launcher watches every rank: when one fails, the others get a
few seconds to notice, then are stopped, so that a broken run never hangs.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from pynccl.testing import find_free_port, process_start

GRACE_S = 10.0  # how long the other ranks may keep running after one failed


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(opts, backend: str) -> int:
    from .runner import run_worker
    if opts.nnodes is not None:
        return launch_nodes(opts, backend)
    if opts.nproc is None:
        if not in_torchrun():
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                               "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                               "MASTER_PORT": str(find_free_port())})
        return run_worker(opts, backend)
    if in_torchrun():
        raise ValueError("--nproc starts its own ranks; under torchrun (RANK and WORLD_SIZE are set) leave it out")
    n = opts.nproc
    if backend == "nccl" and n > torch.cuda.device_count():
        raise ValueError(f"--nproc {n} on nccl needs one GPU per rank, but {torch.cuda.device_count()} "
                         f"CUDA device(s) are visible (NCCL refuses two ranks on one GPU); use --backend gloo "
                         f"for more ranks on CPU")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n)}
    threads = max(1, (os.cpu_count() or 1) // n) if backend == "gloo" else None
    starter = process_start.Starter(cuda=backend == "nccl")
    sys.stdout.flush()
    sys.stderr.flush()
    procs = [starter.process(_child, f"rank{r}", (r, env, opts, backend, threads)) for r in range(n)]
    starter.start(procs)
    return _wait(procs)


def launch_nodes(opts, backend: str) -> int:
    """--nnodes N: N torchrun agents on this host, each a node of --nproc ranks, every rank running
    this benchmark; NCCL between nodes on its socket transport (multinode.socket_env), so the
    network path has figures. The agents' exit codes are the result."""
    from pynccl.testing.multinode import TorchrunNodes, socket_env
    if in_torchrun():
        raise ValueError("--nnodes starts its own torchrun agents; under torchrun leave it out")
    per_node = opts.nproc or 1
    if backend == "nccl" and opts.nnodes * per_node > torch.cuda.device_count():
        raise ValueError(f"--nnodes {opts.nnodes} × --nproc {per_node} on nccl needs one GPU per rank, but "
                         f"{torch.cuda.device_count()} CUDA device(s) are visible")
    args = _without(opts.argv, ("--nnodes", "--nproc")) + ["--backend", backend]
    env = " ".join(f"{k}={v}" for k, v in socket_env(0).items() if k.startswith("NCCL_") and k != "NCCL_HOSTID")
    print(f"# pynccl.bench: {opts.nnodes} nodes × {per_node} rank(s) on this host (torchrun agents), "
          f"{'NCCL' if backend == 'nccl' else 'gloo'} between them over loopback sockets ({env}, "
          f"NCCL_HOSTID per node)", flush=True)
    threads = max(1, (os.cpu_count() or 1) // (opts.nnodes * per_node)) if backend == "gloo" else 1
    nodes = TorchrunNodes(["-m", "pynccl.bench", *args], opts.nnodes, per_node, capture=False,
                          env={"OMP_NUM_THREADS": str(threads)}, gpus_per_node=per_node if backend == "nccl" else 0)
    with nodes:
        runs = nodes.wait(opts.timeout + 120)
    codes = [r.returncode for r in runs]
    if any(r.hung for r in runs):
        print(f"pynccl.bench: nodes {[r.index for r in runs if r.hung]} still running after "
              f"{opts.timeout + 120:.0f} s: stopped", file=sys.stderr)
        return 1
    return 0 if all(c == 0 for c in codes) else max((c for c in codes if c and c > 0), default=1)


def _without(argv, flags) -> list:
    """argv minus the given flags and their values ('--flag V' and '--flag=V')."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


def _child(rank: int, env: dict, opts, backend: str, threads) -> None:
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    if threads is not None:
        torch.set_num_threads(threads)
    code = 1
    try:
        from .runner import run_worker
        code = run_worker(opts, backend)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # NOTE: skip interpreter teardown: gloo/NCCL threads must not keep a rank alive


def _wait(procs) -> int:
    first_failure = None
    try:
        while any(p.is_alive() for p in procs):
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = time.monotonic()
            if first_failure is not None and time.monotonic() - first_failure > GRACE_S:
                for r, p in enumerate(procs):
                    if p.is_alive():
                        print(f"pynccl.bench: stopping rank {r}: another rank failed", file=sys.stderr)
                        p.terminate()
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
        return 130
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        return 0
    return max((c for c in codes if c and c > 0), default=1)
