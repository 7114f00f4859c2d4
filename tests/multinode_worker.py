"""One worker of the multi-node jobs of test_multinode.py (gloo) and test_multinode_gpu.py (NCCL
over sockets), started by torchrun agents (pynccl.testing.multinode):

    torchrun --nnodes 2 --nproc-per-node K ... tests/multinode_worker.py SCENARIO

MN_BACKEND (gloo|nccl), MN_OUT (a folder for results), MN_TIMEOUT (the group timeout, s).
Scenarios: checks (torchrun's variables, node-aware groups, collectives against torch's, DDP and
ZeRO 1-3 and hybrid against one process), node_death (the last node is killed mid-step by the
test; survivors must end), resume (the last node's workers kill themselves at MN_KILL_STEP of a
run that started from scratch; torchrun --max-restarts restarts the job, which resumes from its
last checkpoint). Each rank writes MN_OUT/<scenario>_rank<r>.json; an uncaught error fails it.
"""
import time

STARTED = time.time()    # noqa: E402 - before the imports, which take seconds on a busy machine

import json
import os
import signal
import sys

import torch
import torch._dynamo  # noqa: F401  imported by the first optimizer.step(): before the timed part
import torch.distributed as tdist

import pynccl
from pynccl.checkpoint_io import atomic_save
from pynccl.comm.nodes import node_layout
from pynccl.zero import FullyShardedDataParallel

import hybrid_checks as hc
from test_zero import LR, STEPS, global_batch, local, make_net

BACKEND = os.environ.get("MN_BACKEND", "gloo")
OUT = os.environ.get("MN_OUT", ".")
TIMEOUT_S = float(os.environ.get("MN_TIMEOUT", "60"))
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE")


def write(name, **fields):
    path = os.path.join(OUT, f"{name}_rank{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(fields, f)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------- checks
def check_torchrun_env(rank, ws, per_node):
    env = {k: os.environ.get(k) for k in TORCHRUN_VARS}
    assert int(env["LOCAL_WORLD_SIZE"]) == per_node and int(env["GROUP_WORLD_SIZE"]) == ws // per_node, env
    assert int(env["GROUP_RANK"]) == rank // per_node and int(env["LOCAL_RANK"]) == rank % per_node, env
    assert int(env["ROLE_RANK"]) == rank and int(env["ROLE_WORLD_SIZE"]) == ws, env
    return env


def torch_group(ranks):
    """torch.distributed's group over `ranks` (every rank calls it): its result is the expectation."""
    return tdist.new_group(ranks, backend="nccl" if BACKEND == "nccl" else "gloo")


def check_collectives_vs_torch(rank, ws, groups):
    """On the world, a node's group and the inter-node group: every core collective equals
    torch.distributed's on the same data (deterministic per rank, as nccl-tests' data)."""
    dev = pynccl.get_device()
    for ranks in groups:
        tg = torch_group(ranks)
        mine = pynccl.new_group(ranks)
        if rank not in ranks:
            continue
        n, me = len(ranks), ranks.index(rank)
        base = torch.arange(6 * n, dtype=torch.float32, device=dev) * (rank + 1)
        for op, top in ((pynccl.ReduceOp.SUM, tdist.ReduceOp.SUM), (pynccl.ReduceOp.MAX, tdist.ReduceOp.MAX)):
            a, b = base.clone(), base.clone()
            pynccl.all_reduce(a, op=op, group=mine)
            tdist.all_reduce(b, op=top, group=tg)
            assert torch.equal(a, b), (ranks, op)
        out, tout = torch.empty(6 * n * n, device=dev), torch.empty(6 * n * n, device=dev)
        pynccl.all_gather_into_tensor(out, base, group=mine)
        tdist.all_gather_into_tensor(tout, base, group=tg)
        assert torch.equal(out, tout), ranks
        rs = torch.empty(6, device=dev)
        pynccl.reduce_scatter_tensor(rs, base, group=mine)
        total = base.clone()
        tdist.all_reduce(total, group=tg)                       # gloo has no reduce_scatter_tensor
        assert torch.equal(rs, total[6 * me: 6 * (me + 1)]), ranks
        a, b = base.clone(), base.clone()
        pynccl.broadcast(a, src=ranks[-1], group=mine)
        tdist.broadcast(b, src=ranks[-1], group=tg)
        assert torch.equal(a, b), ranks
        a, b = torch.empty_like(base), torch.empty_like(base)
        pynccl.all_to_all_single(a, base, group=mine)
        tdist.all_to_all_single(b, base, group=tg)
        assert torch.equal(a, b), ranks
        if n == 1:
            continue
        # point to point around the group's ring: every other hop crosses a node
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        got = torch.empty_like(base)
        pynccl.batch_isend_irecv([pynccl.P2POp(pynccl.isend, base, nxt), pynccl.P2POp(pynccl.irecv, got, prv)])[-1].wait()
        assert torch.equal(got, torch.arange(6 * n, dtype=torch.float32, device=dev) * (prv + 1)), ranks
        pynccl.barrier(group=mine)


def check_ddp_and_zero(rank, ws):
    """DDP and ZeRO 1-3 over every rank of both nodes equal one process on the global batch."""
    expected = hc.reference()[0]
    ddp = pynccl.DistributedDataParallel(make_net().to(pynccl.get_device()), bucket_cap_mb=0.0005)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    hc.train(ddp, opt, range(STEPS), rank, ws)
    hc.assert_close({k: v for k, v in ddp.module.state_dict().items()}, expected, "DDP across nodes")
    for stage in (1, 2, 3):
        model, opt = hc.wrap(stage)
        hc.train(model, opt, range(STEPS), rank, ws)
        hc.assert_close(model.full_state_dict(), expected, f"ZeRO stage {stage} across nodes")


def deterministic_gpu():
    """fp32 GEMMs in fp32 (TF32 would be compared against TF32 on another batch shape)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def checks():
    timings, t0 = {"imports": round(time.time() - STARTED, 2)}, time.monotonic()

    def lap(what):
        nonlocal t0
        timings[what] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
    pynccl.init_process_group(BACKEND, timeout=TIMEOUT_S)
    deterministic_gpu()
    rank, ws = pynccl.get_rank(), pynccl.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    env = check_torchrun_env(rank, ws, per_node)
    lap("init")
    hc.check_node_layout(rank, ws, per_node)
    layout = node_layout()
    lap("node layout")
    check_collectives_vs_torch(rank, ws, [list(range(ws))] + layout.nodes + layout.inter_node_groups())
    lap("collectives")
    check_ddp_and_zero(rank, ws)
    lap("ddp and zero")
    shard, replicate = hc.node_groups()
    hc.check_hybrid_training(rank, ws, shard, replicate)
    lap("hybrid training")
    hc.check_hybrid_meshes(rank, ws, per_node)
    lap("hybrid meshes")
    hc.check_hybrid_checkpoints(rank, ws, shard, replicate, OUT)
    lap("hybrid checkpoints")
    if ws == 4 and per_node == 2:
        hc.check_hybrid_errors(rank, ws, shard, replicate)
    pynccl.destroy_process_group()
    lap("destroy")
    write("checks", env=env, ok=True, timings=timings, started=STARTED)


# ---------------------------------------------------------------------- a node dies
def node_death():
    """Hybrid ZeRO-3 training (shards within a node, replicas across): the last node's local
    rank 0 announces step 3 and sleeps inside it, the test kills that node; every survivor must
    end, by an error, within the group timeout + 5 s, with its flight record written."""
    pynccl.init_process_group(BACKEND, timeout=TIMEOUT_S)
    deterministic_gpu()
    rank, ws = pynccl.get_rank(), pynccl.get_world_size()
    victim = int(os.environ["GROUP_RANK"]) == int(os.environ["GROUP_WORLD_SIZE"]) - 1
    shard, replicate = hc.node_groups()
    model, opt = hc.wrap(3, process_group=(shard, replicate))
    dev = pynccl.get_device()
    write("node_death_ready", victim=victim, pid=os.getpid(), local_rank=int(os.environ["LOCAL_RANK"]))
    try:
        for step in range(10_000):
            idx, tgt = (t.to(dev) for t in local(global_batch(step % STEPS), rank, ws))
            loss = model(idx, tgt)
            if step == 3 and victim:
                if int(os.environ["LOCAL_RANK"]) == 0:
                    with open(os.path.join(OUT, "victim_agent"), "w") as f:
                        f.write(str(os.getppid()))
                time.sleep(120)                        # killed here, mid-step
            loss.backward()
            opt.step()
            opt.zero_grad()
            if dev.type == "cuda":
                torch.cuda.synchronize()
    except pynccl.PyncclError as e:
        write("node_death", error=type(e).__name__, message=str(e), at=time.time(), step=step)
        raise
    raise AssertionError("training went on after a node died")


# ---------------------------------------------------------------------- elastic restart
def resume():
    """STEPS*2 steps of hybrid ZeRO-3 with a checkpoint every 2 steps (sharded files, then an
    atomically written pointer). A run that starts from scratch loses its last node at
    MN_KILL_STEP; the restarted job resumes from the last checkpoint. Rank 0 logs each step's
    global loss; the last run writes the final parameters."""
    pynccl.init_process_group(BACKEND, timeout=TIMEOUT_S)
    deterministic_gpu()
    rank, ws = pynccl.get_rank(), pynccl.get_world_size()
    kill_step = int(os.environ.get("MN_KILL_STEP", "-1"))
    shard, replicate = hc.node_groups()
    model, opt = hc.wrap(3, process_group=(shard, replicate))
    pointer = os.path.join(OUT, "latest.pt")
    start = 0
    if os.path.exists(pointer):
        latest = torch.load(pointer, weights_only=True)
        model.load_sharded(latest["path"], opt)
        start = latest["step"] + 1
    dev = pynccl.get_device()
    last_node = int(os.environ["GROUP_RANK"]) == int(os.environ["GROUP_WORLD_SIZE"]) - 1
    for step in range(start, 2 * STEPS):
        if step == kill_step and start == 0 and last_node:
            os.kill(os.getpid(), signal.SIGKILL)        # every worker of the last node: a node lost
        idx, tgt = (t.to(dev) for t in local(global_batch(step), rank, ws))
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().reshape(1).clone()
        pynccl.all_reduce(logged, op=pynccl.ReduceOp.AVG)   # the global mean, as a user logs it
        if rank == 0:
            with open(os.path.join(OUT, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "start": start, "step": step, "loss": logged.item()}) + "\n")
        if step % 2 == 1:
            path = os.path.join(OUT, f"ckpt_step{step}")
            model.save_sharded(path, opt)
            if rank == 0:
                atomic_save({"step": step, "path": path}, pointer)
            pynccl.barrier()
    state = model.full_state_dict()
    if rank == 0:
        atomic_save(state, os.path.join(OUT, "final.pt"))
    write("resume", start=start)
    pynccl.destroy_process_group()


if __name__ == "__main__":
    {"checks": checks, "node_death": node_death, "resume": resume}[sys.argv[1]]()
