"""Point-to-point `tag=` on gloo against torch.distributed in the same ranks: a receive takes its
peer's send of the same tag, whatever order the two sides post them in (send / recv, isend / irecv,
batch_isend_irecv with pynccl's and torch's P2POp, pynccl's batch_work, the any-source recv). Each
case posts the receives in the opposite order of the sends, so a tag dropped anywhere swaps the
values. On nccl tags are not matched, as torch's ProcessGroupNCCL ignores them: the backend
interface's defaults drop them (checked without a GPU).
"""
import types

import torch
import torch.distributed as tdist

import pynccl
from pynccl.comm.backends.base import Backend
from pynccl.comm.p2p import batch_work
from pynccl.testing import run_multiprocess

SENT = {1: 10.0, 2: 20.0}   # tag -> the value sent with it
# NOTE: a receive whose tag no send carries waits for the group's timeout: kept short, so that a tag
# dropped on one side only fails in seconds.
INIT = {"timeout": 10.0}


def _send_both(lib, blocking_first=False):
    """Rank 0: SENT's values to rank 1, tag 1 first. Returns the Works still to wait for."""
    if blocking_first:
        lib.send(torch.tensor([SENT[1]]), 1, tag=1)
        return [lib.isend(torch.tensor([SENT[2]]), 1, tag=2)]
    return [lib.isend(torch.tensor([SENT[t]]), 1, tag=t) for t in (1, 2)]


def _isend_irecv(rank, ws):
    """irecv of tag 2 posted before tag 1's, from isends or a blocking send (tag 1) then an isend."""
    got = {}
    for lib in (tdist, pynccl):
        for blocking in (False, True):
            if rank == 0:
                for w in _send_both(lib, blocking_first=blocking):
                    w.wait()
            else:
                x, y = torch.zeros(1), torch.zeros(1)
                for w in [lib.irecv(x, 0, tag=2), lib.irecv(y, 0, tag=1)]:
                    w.wait()
                got[(lib.__name__, blocking)] = (x.item(), y.item())
            pynccl.barrier()
    if rank == 1:
        for blocking in (False, True):
            assert got[("pynccl", blocking)] == got[("torch.distributed", blocking)] == (SENT[2], SENT[1]), got
    return True


def test_isend_irecv_match_by_tag_as_torch():
    assert run_multiprocess(_isend_irecv, 2, timeout=60, init_kwargs=INIT) == [True, True]


def _blocking_recv(rank, ws):
    """Blocking recv, from a known rank and from any rank (src=None): tag 2 received first."""
    got = {}
    for lib in (tdist, pynccl):
        for src in (0, None):
            if rank == 0:
                for w in _send_both(lib):
                    w.wait()
            else:
                x, y = torch.zeros(1), torch.zeros(1)
                senders = (lib.recv(x, src, tag=2), lib.recv(y, src, tag=1))
                got[(lib.__name__, src)] = (x.item(), y.item(), senders)
            pynccl.barrier()
    if rank == 1:
        for src in (0, None):
            assert got[("pynccl", src)] == got[("torch.distributed", src)] == (SENT[2], SENT[1], (0, 0)), got
    return True


def test_blocking_recv_matches_by_tag_as_torch():
    assert run_multiprocess(_blocking_recv, 2, timeout=60, init_kwargs=INIT) == [True, True]


def _batches(rank, ws):
    """batch_isend_irecv (pynccl's and torch's P2POp) and batch_work: receives in the other order."""
    got = {}
    cases = [("torch", tdist.batch_isend_irecv, tdist.P2POp, tdist.isend, tdist.irecv),
             ("pynccl", pynccl.batch_isend_irecv, pynccl.P2POp, pynccl.isend, pynccl.irecv),
             ("pynccl+torch P2POp", pynccl.batch_isend_irecv, tdist.P2POp, tdist.isend, tdist.irecv),
             ("batch_work", lambda ops: [batch_work(ops)], pynccl.P2POp, pynccl.isend, pynccl.irecv)]
    for name, batch, p2p_op, isend, irecv in cases:
        if rank == 0:
            ops = [p2p_op(isend, torch.tensor([SENT[t]]), 1, tag=t) for t in (1, 2)]
        else:
            x, y = torch.zeros(1), torch.zeros(1)
            ops = [p2p_op(irecv, x, 0, tag=2), p2p_op(irecv, y, 0, tag=1)]
        for w in batch(ops):
            w.wait()
        if rank == 1:
            got[name] = (x.item(), y.item())
        pynccl.barrier()
    if rank == 1:
        assert set(got.values()) == {(SENT[2], SENT[1])}, got
    return True


def test_batch_isend_irecv_matches_by_tag_as_torch():
    assert run_multiprocess(_batches, 2, timeout=60, init_kwargs=INIT) == [True, True]


def test_nccl_backend_drops_tags_as_torch_nccl():
    """The interface's defaults, which the nccl backend inherits: the op without its tag (NCCL has
    none; torch's ProcessGroupNCCL ignores tags too)."""
    calls = []
    fake = types.SimpleNamespace(send=lambda *a: calls.append(("send",) + a) or "w",
                                 recv=lambda *a: calls.append(("recv",) + a) or "w",
                                 batch_isend_irecv=lambda ops: calls.append(("batch", ops)) or "w")
    t = torch.zeros(1)
    assert Backend.send_tagged(fake, t, 1, True, 7) == "w"
    assert Backend.recv_tagged(fake, t, 1, False, 7) == "w"
    assert Backend.batch_isend_irecv_tagged(fake, [(True, t, 1)], [7]) == "w"
    assert Backend.batch_isend_irecv_works(fake, [(True, t, 1)], [7]) == ["w"]
    assert calls == [("send", t, 1, True), ("recv", t, 1, False), ("batch", [(True, t, 1)]),
                     ("batch", [(True, t, 1)])]
