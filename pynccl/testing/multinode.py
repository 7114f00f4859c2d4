"""Multi-node jobs on one host: N torchrun agents, each a "node", started as a cluster starts them.

    runs = run_nodes(["train.py", "--steps", "10"], nnodes=2, nproc_per_node=2, timeout=120)

Each agent runs `torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint
127.0.0.1:PORT` in its own session, so it gets its own GROUP_RANK and LOCAL_* view, restarts its
own workers (--max-restarts) and can be killed alone. All traffic stays on the loopback interface
(socket_env): gloo on lo, and NCCL on its network transport over sockets (P2P and shared memory
off, InfiniBand off, a NCCL_HOSTID per node so that NCCL counts N hosts). With GPUs agent i sees
GPUs [i*K, (i+1)*K) only (gpus_per_node: K by default where a GPU is visible; 0: CPU nodes, which see
no GPU). Every exit code is checked, within a bounded time, and a failure shows
the failing node's output (torchrun tees each worker's lines into it, prefixed by local rank).

kill_node(i) SIGKILLs agent i and every process under it: torchrun starts its workers in sessions
of their own, so killing the agent's process group alone would leave them running.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from . import find_free_port


class MultiNodeError(AssertionError):
    """A node failed, hung or died; the message shows each one's output."""


def socket_env(node: int) -> Dict[str, str]:
    """Environment of node `node`: every transport on the loopback interface, NCCL between nodes
    over its socket transport, as between hosts without InfiniBand."""
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_HOSTID": f"pynccl-node{node}",
            "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class NodeRun:
    """What one agent did: its exit code (None: killed by the harness while still running) and
    its output, workers' lines included."""
    index: int
    returncode: Optional[int]
    output: str
    hung: bool = False

    def describe(self, tail: int = 6000) -> str:
        state = "still running at the deadline (killed)" if self.hung else f"exit code {self.returncode}"
        return f"--- node {self.index}: {state}; its output (last {tail} characters):\n{self.output[-tail:]}"


def _stat(pid) -> Optional[List[str]]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ..., starttime at [19])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(pid: int) -> List[int]:
    """`pid` and every process below it."""
    children: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        fields = _stat(name) if name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _identity(pid: int):
    """(pid, start time): a pid that was reused by another process later has another start time."""
    fields = _stat(pid)
    return None if fields is None else (pid, fields[19])


class TorchrunNodes:
    """N torchrun agents on this host; see the module docstring. A context manager: on exit any
    agent or worker still alive is killed."""

    def __init__(self, script_args: Sequence[str], nnodes: int = 2, nproc_per_node: int = 2, *,
                 env: Optional[Dict[str, str]] = None, max_restarts: int = 0, gpus_per_node: Optional[int] = None,
                 monitor_interval: float = 0.2, capture: bool = True, log_dir: Optional[str] = None):
        self.script_args = [str(a) for a in script_args]
        self.nnodes, self.nproc_per_node, self.max_restarts = nnodes, nproc_per_node, max_restarts
        self.env = dict(env or {})
        self.gpus_per_node = gpus_per_node
        self.monitor_interval = monitor_interval
        self.capture = capture
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="pynccl_nodes_")
        self.port = None
        self.procs: List[subprocess.Popen] = []
        self._outputs = []
        self._seen = set()                             # (pid, start time) of every worker seen

    def _agent_command(self, run_id: str) -> List[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nnodes),
               "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", run_id, "--local-addr", "127.0.0.1",
               "--max-restarts", str(self.max_restarts), "--monitor-interval", str(self.monitor_interval)]
        if self.capture:
            cmd += ["--tee", "3"]
        return cmd + self.script_args

    def _node_env(self, node: int) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(socket_env(node))
        env.update(self.env)
        gpus = self.gpus_per_node
        if gpus is None:
            gpus = self.nproc_per_node if _cuda_device_count() else 0
        if not gpus:
            # CPU nodes see no GPU, as on a host without one (process_start.py: a CPU rank that
            # finds a GPU has torch code touch it: AdamW's capture check, dynamo's RNG state).
            env["CUDA_VISIBLE_DEVICES"] = ""
            return env
        # NOTE: through the parent's own CUDA_VISIBLE_DEVICES, if it has one.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(_cuda_device_count())]
        if len(devices) < self.nnodes * gpus:
            raise ValueError(f"TorchrunNodes: {self.nnodes} nodes × {gpus} GPU(s) need {self.nnodes * gpus} GPUs, "
                             f"{len(devices)} visible; pass gpus_per_node=0 for nodes on CPU")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[node * gpus + g] for g in range(gpus))
        return env

    def start(self) -> "TorchrunNodes":
        self.port = find_free_port()
        run_id = f"pynccl-{os.getpid()}-{self.port}"
        for node in range(self.nnodes):
            if self.capture:
                out = open(os.path.join(self.log_dir, f"node{node}.log"), "w+")
                self._outputs.append(out)
            else:
                out = None
            self.procs.append(subprocess.Popen(self._agent_command(run_id), env=self._node_env(node), stdout=out,
                                               stderr=subprocess.STDOUT if out else None, start_new_session=True))
            if node == 0:
                # NOTE: agent 0 hosts the rendezvous store once its port listens: the others find it
                # there, so which node hosts it (and survives kill_node of another) is known.
                self._wait_for_port(60.0)
        return self

    def _wait_for_port(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[0].poll() is not None:
                return                                 # agent 0 died: wait() reports it
            with socket.socket() as s:
                s.settimeout(0.2)
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)

    def agent_index(self, pid: int) -> int:
        """The node whose agent is `pid` (a worker's os.getppid())."""
        return [p.pid for p in self.procs].index(pid)

    def worker_pids(self, node: int) -> List[int]:
        return process_tree(self.procs[node].pid)[1:]

    def kill_node(self, node: int) -> float:
        """SIGKILL agent `node` and every process under it (a node dying); returns the time."""
        tree = process_tree(self.procs[node].pid)
        when = time.monotonic()
        for pid in tree:                               # agent first: it must not react to its workers dying
            _kill(pid)
        return when

    def _track(self) -> None:
        """Remember the workers: once its agent is gone, a worker is an orphan no tree leads to."""
        for p in self.procs:
            if p.poll() is None:
                self._seen.update(filter(None, map(_identity, process_tree(p.pid)[1:])))

    def wait(self, timeout: float) -> List[NodeRun]:
        """Wait up to `timeout` s for every agent; kill whatever is left then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            self._track()
            time.sleep(0.1)
        hung = [p.poll() is None for p in self.procs]
        self.close()
        return [NodeRun(i, None if h else p.returncode, self._output(i), h)
                for i, (p, h) in enumerate(zip(self.procs, hung))]

    def _output(self, node: int) -> str:
        if not self.capture:
            return ""
        f = self._outputs[node]
        f.flush()
        f.seek(0)
        return f.read()

    def close(self) -> None:
        self._track()
        for node, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill_node(node)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for pid, start in self._seen:                  # orphaned workers of agents that are gone
            if _identity(pid) == (pid, start):
                _kill(pid)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:                          # no agent outlives a start that failed halfway
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        self.close()
        for f in self._outputs:
            f.close()
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_runs(runs: List[NodeRun], expect_failure: Sequence[int] = (), what: str = "job") -> None:
    """MultiNodeError naming every node that hung or exited non-zero (unless expected to fail)."""
    bad = [r for r in runs if r.hung or (r.returncode != 0 and r.index not in expect_failure)]
    if bad:
        raise MultiNodeError(f"{what}: {len(bad)} of {len(runs)} node(s) failed:\n" + "\n".join(r.describe() for r in bad))


def run_nodes(script_args: Sequence[str], nnodes: int = 2, nproc_per_node: int = 2, timeout: float = 120.0,
              expect_failure: Sequence[int] = (), **kwargs) -> List[NodeRun]:
    """Start the nodes, wait for them (bounded), check every exit code; returns each node's run."""
    with TorchrunNodes(script_args, nnodes, nproc_per_node, **kwargs) as nodes:
        runs = nodes.wait(timeout)
    check_runs(runs, expect_failure, " ".join(map(str, script_args)))
    return runs
