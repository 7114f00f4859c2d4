"""Every live NCCL communicator runs its ops on a CUDA stream no other live communicator of its
device uses (csrc/comm_stream.cpp, unshared_stream). torch's stream pool hands out 32 streams per
priority round-robin, shared with torch.cuda.Stream(); before, two communicators made 32·k draws
apart shared one stream, so their collectives queued behind each other, and ZeRO-3's reduce-scatter
communicator, kept apart so that its reduces never hold back the all-gathers, could deadlock.
Here 40 communicators (more than the pool) are made with pool draws between them: all distinct;
destroyed ones give their stream back."""
import pytest
import torch

from pynccl.testing import run_multiprocess

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _streams(rank, ws):
    import pynccl
    from pynccl.comm.process_group import get_default_group
    groups = [pynccl.new_group()]
    for i in range(39):
        torch.cuda.Stream(priority=-1)              # another library's draw from the same pool
        groups.append(pynccl.new_group())
    handles = [g.backend.comm.stream_handle for g in groups] + [get_default_group().backend.comm.stream_handle]
    assert all(h != 0 for h in handles) and len(set(handles)) == len(handles), handles
    for g in groups[:20]:
        pynccl.destroy_process_group(g)
    more = [pynccl.new_group() for _ in range(20)]
    live = [g.backend.comm.stream_handle for g in groups[20:] + more]
    assert len(set(live)) == len(live), live
    x = torch.ones(4, device=pynccl.get_device())
    for g in more:
        pynccl.all_reduce(x, group=g)                 # the fresh streams work
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, ws ** len(more)))
    return True


@pytest.mark.gpu
@needs_gpu
def test_live_communicators_never_share_a_stream():
    assert run_multiprocess(_streams, 1, backend="nccl", start_method="spawn", timeout=300) == [True]
