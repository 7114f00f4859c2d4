"""One rank of a fault scenario on NCCL, run as its own process by tests/test_faults_gpu.py.

    python tests/fault_worker.py CASE      (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* set by the test)

A rank prints "T0 <time.time()>" when the faulty phase starts and "RESULT <json>" if it gets to
the end; the test measures each survivor's exit (or raise) against its T0. A case is a plain
function of (rank, world_size); the rank it makes fail is always rank 1, the victim.
"""
import datetime
import json
import os
import signal
import sys
import time

import torch

import pynccl

TIMEOUT_S = float(os.environ.get("FAULT_TIMEOUT_S", "10"))
VICTIM = 1


def mark_start():
    print(f"T0 {time.time():.6f}", flush=True)


def result(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def init():
    pynccl.init_process_group("nccl", timeout=TIMEOUT_S)
    return torch.ones(1 << 16, device=pynccl.get_device())


def error_fields(e):
    return {"error": type(e).__name__, "message": str(e), "seconds": time.time()}


# ----------------------------------------------------------------------------- cases
def killed_mid_loop(rank, ws):
    """The victim dies at step 3 of a loop of all_reduces; each step waits for the GPU."""
    t = init()
    try:
        for step in range(100_000):
            if step == 3:
                if rank == VICTIM:
                    die()
                mark_start()
            pynccl.all_reduce(t)
            torch.cuda.synchronize()
    except pynccl.PyncclError as e:  # on_timeout=raise only; the default ends the process
        result(**error_fields(e))
        return
    result(outcome="loop ended")


def skipped_collective(rank, ws):
    """The victim stays alive but skips one all_reduce. A survivor that printed CONSUMED would
    have used the output of an op that never completed as if it had."""
    t = init()
    pynccl.all_reduce(t)
    torch.cuda.synchronize()
    if rank == VICTIM:
        time.sleep(TIMEOUT_S + 3)
        os._exit(0)
    mark_start()
    work = None
    try:
        work = pynccl.all_reduce(t, async_op=True)
        if os.environ.get("PYNCCL_ON_TIMEOUT") == "raise":
            work.synchronize()  # the host wait that raises; torch.cuda.synchronize() would not
        else:
            work.wait()
            torch.cuda.synchronize()
        print(f"CONSUMED {t[0].item()}", flush=True)
    except pynccl.PyncclError as e:
        fields = error_fields(e)
        try:
            work.wait()
            fields["work_wait"] = "returned"
        except pynccl.PyncclError as again:
            fields["work_wait"] = type(again).__name__
        fields["flight_record"] = [(x["op"], x["seq"], x["state"]) for x in pynccl.flight_record()]
        result(**fields)
        pynccl.abort_process_group()
        return
    result(outcome="completed")


def missing_at_rendezvous(rank, ws):
    """The victim never starts: the store rendezvous names it."""
    if rank == VICTIM:
        os._exit(0)
    mark_start()
    try:
        pynccl.init_process_group("nccl", timeout=TIMEOUT_S)
    except pynccl.CommTimeoutError as e:
        result(**error_fields(e))
        return
    result(outcome="initialised")


def missing_at_nccl_init(rank, ws):
    """Every rank takes the unique id, then the victim leaves before ncclCommInitRankConfig."""
    from pynccl.comm.backends.nccl import NcclBackend, get_unique_id
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ws, rank == 0,
                                       timeout=datetime.timedelta(seconds=60))
    if rank == 0:
        store.set("uid", get_unique_id())
    uid = store.get("uid")
    if rank == VICTIM:
        os._exit(0)
    mark_start()
    try:
        NcclBackend.create(uid, ws, rank, int(os.environ["LOCAL_RANK"]), TIMEOUT_S, name="world")
    except pynccl.PyncclError as e:
        result(**error_fields(e))
        os._exit(0)
    result(outcome="initialised")
    os._exit(0)


def killed_before_first_p2p(rank, ws):
    """The victim dies before any send/recv reached it: rank 0 sends to it, ranks >= 2 receive
    from it; each is the first point-to-point exchange with the victim."""
    t = init()
    pynccl.all_reduce(t)
    torch.cuda.synchronize()
    if rank == VICTIM:
        die()
    mark_start()
    try:
        if rank == 0:
            pynccl.send(t, VICTIM)
        else:
            pynccl.recv(t, VICTIM)
        torch.cuda.synchronize()
        pynccl.barrier()
    except pynccl.PyncclError as e:
        result(**error_fields(e))
        pynccl.abort_process_group()
        return
    result(outcome="completed")


def recv_never_posted(rank, ws):
    """Ranks 0 and 1 exchange once (connected), then rank 0 sends again and the victim, alive,
    never posts the recv; the other ranks wait in an all_reduce the victim never joins. 64 MiB:
    more than NCCL's buffers, so the send cannot complete before a recv is posted."""
    init()
    t = torch.ones(1 << 24, device=pynccl.get_device())
    if rank == 0:
        pynccl.send(t, VICTIM)
    elif rank == VICTIM:
        pynccl.recv(t, 0)
    torch.cuda.synchronize()
    pynccl.all_reduce(t)
    torch.cuda.synchronize()
    if rank == VICTIM:
        time.sleep(TIMEOUT_S + 3)
        os._exit(0)
    mark_start()
    try:
        if rank == 0:
            pynccl.send(t, VICTIM)
        else:
            pynccl.all_reduce(t)
        torch.cuda.synchronize()
        pynccl.barrier()
    except pynccl.PyncclError as e:
        result(**error_fields(e))
        pynccl.abort_process_group()
        return
    result(outcome="completed")


def killed_during_new_group(rank, ws):
    """The victim dies instead of joining new_group (ncclCommSplit on every rank)."""
    t = init()
    pynccl.all_reduce(t)
    torch.cuda.synchronize()
    if rank == VICTIM:
        die()
    mark_start()
    try:
        pynccl.new_group(list(range(ws)))
    except pynccl.PyncclError as e:
        result(**error_fields(e))
        pynccl.abort_process_group()
        return
    result(outcome="created")


def destroy_after_peer_died(rank, ws):
    """The victim dies after the last collective; the others destroy the default group."""
    t = init()
    pynccl.all_reduce(t)
    torch.cuda.synchronize()
    if rank == VICTIM:
        die()
    time.sleep(1.0)  # the victim is gone
    mark_start()
    try:
        pynccl.destroy_process_group()
    except pynccl.PyncclError as e:
        result(**error_fields(e))
        return
    result(outcome="destroyed", seconds=time.time())


CASES = {f.__name__: f for f in (killed_mid_loop, skipped_collective, missing_at_rendezvous, missing_at_nccl_init,
                                 killed_before_first_p2p, recv_never_posted, killed_during_new_group,
                                 destroy_after_peer_died)}

if __name__ == "__main__":
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    CASES[sys.argv[1]](rank, ws)
    # NOTE: a normal interpreter exit (no os._exit): after an error it must not hang.
    sys.exit(0)
