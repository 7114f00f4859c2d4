"""ZeRO-3's backward pacing settings (pynccl/zero/backward_pacing.py); the pacing itself needs a GPU
that runs behind the host: tests/test_zero3_pacing_gpu.py."""
import os

import pytest
import torch

from pynccl.errors import PacingTimeoutError
from pynccl.zero.backward_pacing import DEFAULT_LEAD, ENV, BackwardPacer, lead_from_env


def test_lead_from_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert lead_from_env() == DEFAULT_LEAD == 2
    monkeypatch.setenv(ENV, " 0 ")
    assert lead_from_env() == 0
    monkeypatch.setenv(ENV, "5")
    assert lead_from_env() == 5
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=rf"{ENV} must be a whole number of blocks >= 0 .*got '{bad}'"):
            lead_from_env()


def test_cpu_never_waits():
    pacer = BackwardPacer(torch.device("cpu"), 2, 60.0)
    assert pacer.lead == 0
    assert not any(pacer.block(i) for i in range(10))
    assert pacer.waits == 0


def _bad_lead_case(rank, ws):
    import pynccl
    with pytest.raises(ValueError, match=ENV):
        pynccl.FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), stage=3)
    return True


def test_bad_lead_is_refused_when_wrapping(monkeypatch):
    from pynccl.testing import run_multiprocess
    assert run_multiprocess(_bad_lead_case, 1, backend="gloo", env={ENV: "-3"}) == [True]


def test_a_gpu_that_never_gets_there_raises_instead_of_hanging(monkeypatch):
    """The wait is bounded by twice the group's timeout (the watchdog acts at one): a fake event that
    never completes, on a pacer made as on CUDA, raises TimeoutError naming the unit and the lead."""
    from pynccl.zero import backward_pacing

    class NeverDone:
        def record(self):
            pass

        def query(self):
            return False

    monkeypatch.setattr(backward_pacing.torch.cuda, "Event", NeverDone)
    monkeypatch.setattr(backward_pacing.torch.cuda, "is_current_stream_capturing", lambda: False)
    pacer = BackwardPacer(torch.device("cuda"), 2, timeout_s=0.05)
    assert not pacer.block(11) and not pacer.block(10)          # the first `lead` blocks never wait
    assert not pacer.block(10)                                  # announced again: counted once
    with pytest.raises(PacingTimeoutError, match=r"before unit 9.s backward, the GPU did not reach unit 11.s "
                                                r"backward \(2 back\) within 0\.1 s"):
        pacer.block(9)


def _connect_case(rank, ws):
    """One reduce per distinct unit size, on the reduce group, every rank alike; the units' reduces
    of a real gradient give the same shards after it as without it."""
    import pynccl
    from pynccl.zero.backward_pacing import connect_reduce_paths

    def shard_grads(connect):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
        model = pynccl.FullyShardedDataParallel(net, stage=3, wrap_modules=[torch.nn.Linear])
        units = model._runtime.units
        assert len(units) == 3 and len({u.layout.padded_numel for u in units}) == 2, [u.layout for u in units]
        assert connect_reduce_paths(units) == 0                  # CPU units: nothing to connect
        if connect:
            assert connect_reduce_paths(units, device_types=("cpu",)) == 2
        model(torch.full((2, 8), float(rank + 1))).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(shard_grads(False), shard_grads(True)):
        assert torch.equal(a, b)
    return True


def test_connect_reduce_paths_runs_one_reduce_per_size():
    from pynccl.testing import run_multiprocess
    assert run_multiprocess(_connect_case, 2, backend="gloo") == [True, True]


def _connect_whatever_the_lead(rank, ws):
    """Whether a rank makes the wrap-time reduces must not depend on its own environment: with the
    pacing off (lead 0) the runtime still calls connect_reduce_paths on its units."""
    import pynccl
    import pynccl.zero.stage3 as stage3
    calls = []
    real = stage3.connect_reduce_paths
    stage3.connect_reduce_paths = lambda units: calls.append(len(units)) or real(units)
    os.environ[ENV] = "0"
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    model = pynccl.FullyShardedDataParallel(net, stage=3, wrap_modules=[torch.nn.Linear])
    assert model._runtime._pacer.lead == 0 and calls == [len(model._runtime.units)], calls
    return True


def test_wrap_time_reduces_run_whatever_the_lead():
    from pynccl.testing import run_multiprocess
    assert run_multiprocess(_connect_whatever_the_lead, 2, backend="gloo") == [True, True]
