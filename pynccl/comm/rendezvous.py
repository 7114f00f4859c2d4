"""Rendezvous: who am I, where is the store, and the NCCL unique-id exchange.

The store is torch's TCPStore (rank 0 hosts it on MASTER_ADDR:MASTER_PORT, or torchrun's
agent does). torch.distributed's default group is set up on it, as torch's own
init_process_group would make it for the same backend ("cpu:gloo,cuda:nccl" for nccl, "gloo"
for gloo), so that torch code in a script that only called pynccl (DistributedSampler,
init_device_mesh, DTensor, fully_shard, torch.distributed's collectives) works.
"""
from __future__ import annotations

import datetime
import errno
import os
import socket
import time
from typing import Optional, Tuple

import torch
import torch.distributed as tdist

from ..errors import CommTimeoutError

_generation = 0


def next_generation() -> int:
    """Same sequence on every rank (each init bumps it), so store keys never collide."""
    global _generation
    _generation += 1
    return _generation


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"init_process_group: environment variable {name} is not set (env:// rendezvous reads "
                         f"RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them); "
                         f"pass rank= and world_size= or launch with torchrun")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"init_process_group: {name}={value!r} is not an integer") from None


def _parse_init_method(init_method: Optional[str]) -> Tuple[Optional[str], Optional[int]]:
    if init_method in (None, "env://"):
        return None, None
    if init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://"):].rpartition(":")
        return host, int(port)
    raise ValueError(f"init_process_group: init_method must be 'env://' or 'tcp://host:port', got {init_method!r}")


def torch_backend_for(backend: str) -> str:
    """torch.distributed's default-group backend beside a pynccl default group of `backend`.
    NOTE: torch's ProcessGroupNCCL made without device_id creates its communicator at its first
    CUDA collective, so a script that never uses torch's collectives pays nothing for it."""
    if backend == "nccl" and tdist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def bootstrap(init_method, rank: int, world_size: int, timeout_s: float, store,
              torch_backend: str = "gloo") -> Tuple[int, int, object, bool]:
    """Returns (rank, world_size, store, owns_torch_dist)."""
    if tdist.is_available() and tdist.is_initialized():
        # Reuse the script's torch.distributed setup.
        t_rank, t_world = tdist.get_rank(), tdist.get_world_size()
        if rank not in (-1, t_rank) or world_size not in (-1, t_world):
            raise ValueError(f"init_process_group: torch.distributed is initialised with rank={t_rank}, "
                             f"world_size={t_world}, but rank={rank}, world_size={world_size} were given")
        return t_rank, t_world, tdist.distributed_c10d._get_default_store(), False

    if rank == -1:
        rank = _env_int("RANK")
    if world_size == -1:
        world_size = _env_int("WORLD_SIZE")
    if world_size < 1:
        raise ValueError(f"init_process_group: world_size must be ≥ 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_process_group: rank {rank} out of range [0, world_size={world_size})")

    if store is None:
        host, port = _parse_init_method(init_method)
        if host is None:
            host = os.environ.get("MASTER_ADDR")
            if host is None:
                raise ValueError("init_process_group: environment variable MASTER_ADDR is not set "
                                 "(env:// rendezvous); launch with torchrun or set MASTER_ADDR/MASTER_PORT")
            port = _env_int("MASTER_PORT")
        # torchrun's agent already hosts the store on MASTER_PORT: connect as a client.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        is_master = rank == 0 and not agent_store
        store = _connect_store(host, port, world_size, rank, is_master, timeout_s)
        if agent_store:
            # The agent's store outlives its workers (torchrun --max-restarts): one key space per attempt.
            from .elastic_store import fresh_key_space
            store = fresh_key_space(store, rank, world_size, timeout_s)

    _check_unique_rank(store, rank, world_size, timeout_s)
    try:
        tdist.init_process_group(torch_backend, store=tdist.PrefixStore("torch", store), rank=rank,
                                 world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise CommTimeoutError(f"init_process_group: rank {rank}: torch.distributed's default group of {world_size} "
                               f"ranks did not form within {timeout_s:.0f}s: {e}") from e
    return rank, world_size, store, True


def _bound_listen_fd(host: str, port: int) -> int:
    """A socket listening on MASTER_ADDR only (TCPStore on its own listens on every interface).
    NOTE: the descriptor is detached: TCPStore owns (and closes) it from here on."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)
    return sock.detach()


def _connect_store(host: str, port: int, world_size: int, rank: int, is_master: bool, timeout_s: float):
    try:
        kwargs = {}
        if is_master:
            kwargs["master_listen_fd"] = _bound_listen_fd(host, port)
        return tdist.TCPStore(host, port, world_size, is_master,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              multi_tenant=False, **kwargs)
    except OSError as e:
        if is_master and e.errno == errno.EADDRINUSE:
            raise ValueError(f"init_process_group: rank {rank} could not host the store on {host}:{port}: the "
                             f"address is in use (two processes claiming rank 0, or another job on this port)") from e
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        what = f"host the store on {host}:{port}" if is_master else f"reach the store at {host}:{port}"
        raise CommTimeoutError(f"init_process_group: rank {rank} could not {what} within {timeout_s:.0f}s: {e}") from e


def _check_unique_rank(store, rank: int, world_size: int, timeout_s: float):
    """Every rank announces itself; a duplicated rank or a wrong world size fails here,
    and a rank that never arrives is named, all within the timeout. A store that goes away
    meanwhile (rank 0, its host, found the job misconfigured and ended, or died) is a
    CommTimeoutError saying so, not torch's bare connection error."""
    try:
        _announce_and_wait(store, rank, world_size, timeout_s)
    except CommTimeoutError:
        raise
    except RuntimeError as e:        # torch's DistNetworkError / DistStoreError: the store's connection
        raise CommTimeoutError(f"init_process_group: rank {rank} lost the rendezvous store while joining "
                               f"{world_size} ranks (rank 0, its host, gave up or died; its error says why): "
                               f"{e}") from e


def _announce_and_wait(store, rank: int, world_size: int, timeout_s: float):
    gen = _generation + 1
    agreed = store.compare_set(f"pynccl/rdzv{gen}/world_size", "", str(world_size)).decode()
    if agreed != str(world_size):
        raise ValueError(f"init_process_group: rank {rank} was started with world_size={world_size}, but another "
                         f"process of this job with world_size={agreed}; check WORLD_SIZE on every rank")
    key = f"pynccl/rdzv{gen}/rank{rank}"
    if store.add(key, 1) != 1:
        raise ValueError(f"init_process_group: two processes claim rank {rank} (world_size={world_size})")
    arrived = store.add(f"pynccl/rdzv{gen}/count", 1)
    if arrived > world_size:
        raise ValueError(f"init_process_group: more than world_size={world_size} processes joined the rendezvous "
                         f"(this is process #{arrived}); check WORLD_SIZE on every rank")
    # NOTE: rank 0 hosts the store, so it gives up last: the others can still read who is missing.
    deadline = time.monotonic() + timeout_s + (1.0 if rank == 0 else 0.0)
    while True:
        n = store.add(f"pynccl/rdzv{gen}/count", 0)
        if n == world_size:
            return
        if n > world_size:
            raise ValueError(f"init_process_group: {n} processes joined a rendezvous for world_size={world_size}; "
                             f"check WORLD_SIZE on every rank")
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if store.add(f"pynccl/rdzv{gen}/rank{r}", 0) == 0]
            raise CommTimeoutError(f"init_process_group: rank {rank} waited {timeout_s:.0f}s for "
                                   f"{world_size} ranks; ranks {missing} never arrived")
        time.sleep(0.01 if time.monotonic() + 1 < deadline else 0.001)


def exchange_unique_id(store, prefix: str, rank: int, timeout_s: float) -> bytes:
    key = f"{prefix}/nccl_unique_id"
    if rank == 0:
        from .backends.nccl import get_unique_id
        uid = get_unique_id()
        store.set(key, uid)
        return uid
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001
        raise CommTimeoutError(f"init_process_group: rank {rank} did not receive rank 0's NCCL unique id "
                               f"within {timeout_s:.0f}s: {e}") from e
    return store.get(key)


def resolve_cuda_device(device_id) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("init_process_group(backend='nccl'): no CUDA device is visible to this process; "
                           "use backend='gloo' on CPU")
    if device_id is None:
        idx = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    elif isinstance(device_id, torch.device):
        idx = device_id.index if device_id.index is not None else torch.cuda.current_device()
    else:
        idx = int(device_id)
    if not 0 <= idx < torch.cuda.device_count():
        raise ValueError(f"init_process_group: device {idx} out of range: {torch.cuda.device_count()} CUDA "
                         f"device(s) visible (LOCAL_RANK={os.environ.get('LOCAL_RANK')})")
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


def shutdown_torch_dist():
    if tdist.is_initialized():
        tdist.destroy_process_group()
