"""ZeRO-3's backward pacing on NCCL (pynccl/zero/backward_pacing.py): with a GPU far behind the host,
the reduce-scatter inputs alive stay bounded by the lead instead of growing with the blocks the host
ran ahead; blocks skipped on one rank under pacing neither hang nor change the result; pacing
changes nothing numerically (parameters bit-identical to an unpaced run).

The GPU is kept behind with a ~10 ms sleep kernel in each block's backward (the host enqueues a
block's backward in well under 1 ms), with and without activation checkpointing."""
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pynccl
from pynccl.testing import run_multiprocess
from pynccl.zero.backward_pacing import ENV

from test_zero_gpu import _SlowBackward            # identity whose backward keeps the stream busy ~10 ms

BLOCKS, D, ROWS, STEPS, LEAD = 12, 64, 32, 3, 2
SKIP_STEP, SKIPPED = 1, (3, 4, 5)      # rank 1 skips these blocks in step SKIP_STEP


class SlowBlocks(nn.Module):
    """`head`: an input and an output layer of other sizes, outside the blocks (the root unit: a
    reduce of a size no block has, the first of its size only at the end of backward)."""

    def __init__(self, ckpt: bool, head: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(BLOCKS)])
        self.ckpt = ckpt
        self.inp, self.out = (nn.Linear(D, D), nn.Linear(D, 3 * D)) if head else (None, None)

    def forward(self, x, skip=()):
        if self.inp is not None:
            x = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i in skip:
                continue
            h = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
            x = _SlowBackward.apply(h)
        return (self.out(x) if self.out is not None else x).square().mean()


def _run(device, rank, ws, lead: int, ckpt: bool, head: bool = False, skip_step: int = SKIP_STEP):
    os.environ[ENV] = str(lead)
    torch.manual_seed(0)
    model = pynccl.FullyShardedDataParallel(SlowBlocks(ckpt, head).to(device), stage=3,
                                            wrap_modules=[nn.Sequential] if head else None)
    rt = model._runtime
    assert rt._pacer.lead == lead
    pending_per_step = []
    append = rt.in_flight.append

    def recording_append(p):
        append(p)
        pending_per_step[-1] = max(pending_per_step[-1], len(rt.in_flight.pending))

    rt.in_flight.append = recording_append
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(ws * ROWS, D, generator=g)[rank * ROWS:(rank + 1) * ROWS].to(device)
        skip = SKIPPED if (step == skip_step and rank == 1) else ()
        pending_per_step.append(0)
        model(x, skip).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    state = {k: v.clone() for k, v in model.full_state_dict().items()}
    return pending_per_step, rt._pacer.waits, state


def _case(rank, ws):
    device = pynccl.get_device()
    assert device.type == "cuda"
    for ckpt in (False, True):
        unpaced, _, ref = _run(device, rank, ws, 0, ckpt)
        paced, waits, state = _run(device, rank, ws, LEAD, ckpt)
        clean = [s for s in range(STEPS) if ws == 1 or s != SKIP_STEP]
        # The premise: unpaced, the host runs ahead and every block's reduce input stays alive.
        assert max(unpaced[s] for s in clean) >= BLOCKS - 2, (ckpt, unpaced)
        # Paced: at block k the host waited for the GPU to reach block k + LEAD, so the reduces of
        # blocks k+1 .. k+LEAD, the one just started and at most one still running are alive.
        assert max(paced[s] for s in clean) <= LEAD + 2, (ckpt, paced)
        assert waits >= STEPS * (BLOCKS - LEAD) - len(SKIPPED), (ckpt, waits)
        for k, v in ref.items():
            assert torch.equal(state[k], v), (ckpt, k)
    return True


def _case_head(rank, ws):
    """The case the wrap-time connection (connect_reduce_paths) is for: rank 1 skips blocks in the
    very first backward of a model whose root unit has a size of its own. Without the connection,
    rank 0's first reduce of that size blocks its host inside NCCL's connect until rank 1 makes
    it, while rank 1, paced, waits for gathers rank 0 has not started: a hang (the pytest time-out
    fails it). With it: no hang, and the result is bit-identical to the unpaced run."""
    device = pynccl.get_device()
    _, _, ref = _run(device, rank, ws, 0, False, head=True, skip_step=0)
    _, waits, state = _run(device, rank, ws, LEAD, False, head=True, skip_step=0)
    assert waits > 0
    for k, v in ref.items():
        assert torch.equal(state[k], v), k
    return True


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.gpu
@needs_gpu
def test_paced_backward_bounds_reduce_inputs_one_gpu():
    assert run_multiprocess(_case, 1, backend="nccl", start_method="spawn", timeout=300) == [True]


@pytest.mark.multigpu
@needs_2_gpus
def test_paced_backward_with_a_skipping_rank_two_gpus():
    assert run_multiprocess(_case, 2, backend="nccl", start_method="spawn", timeout=300) == [True, True]


@pytest.mark.multigpu
@needs_2_gpus
def test_paced_first_backward_skipping_blocks_with_a_root_of_its_own_size():
    assert run_multiprocess(_case_head, 2, backend="nccl", start_method="spawn", timeout=240) == [True, True]
