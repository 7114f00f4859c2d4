"""One timed mode of ddp_bench: a model, its optimizer and a step (eager, or a CUDA graph replay)
under no wrapper (the floor), torch DDP or pynccl DDP (optionally with one of levers.py's levers);
and the step timer. Every mode builds the same model from the same seed and trains on the same
fixed batch, so step times differ only by the data-parallel wrapper.
"""
import contextlib
import time

import torch
import torch.nn as nn

import pynccl
from pynccl.comm.symmetric import alloc_symmetric

from . import levers as lv
from .models import MODELS, make_optimizer

FLOOR = "no DDP"                                 # the floor: the same per-GPU work, no wrapper, no communication
PY_PATH = "pynccl DDP py-path"                   # eager, buckets through Python (reducer.allow_fused = False)
COMM_PRIO0 = "pynccl DDP comm-prio0"             # eager, the communicator's stream at normal priority
ALL_PRIO0 = "pynccl DDP all-prio0"               # ... and the pack stream too
VIEW = " [view]"                                 # suffix of gradient_as_bucket_view=True modes
# The best any all-reduce DDP could do: the floor, plus all-reduces of as many fp32 bytes as the
# gradients, in 25 MiB buckets, started when backward starts and waited for only before the
# optimizer: no dependency on backward, nothing exposed at its end. What this mode costs over the
# floor is what NCCL's kernels take from backward's compute (SMs, memory bandwidth) alone.
ORACLE = "no DDP + hidden all-reduce"
ORACLE_BUCKET_BYTES = 25 * 2 ** 20


def step_times_ms(fn, iters, device, host=None):
    """ms of fn() for each of `iters` back-to-back runs: CUDA events on a GPU, the host clock on
    CPU. If `host` is a list, the host time each call took to return (launch time, no sync) is
    appended to it."""
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        if host is not None:
            host.extend(times)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        t0 = time.perf_counter()
        fn()
        if host is not None:
            host.append(1e3 * (time.perf_counter() - t0))
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


class Trainer:
    """One mode: model + optimizer + a step function (eager, or a CUDA graph replay)."""

    def __init__(self, mode, args, device, torch_pg, batch, lever=None, group=None):
        torch.manual_seed(0)
        # None: the argument not passed (each constructor's default; ddp_bench's --grad-view default)
        grad_view = True if mode.endswith(VIEW) else (None if getattr(args, "grad_view", "off") == "default" else False)
        cuda = device.type == "cuda"
        device_ids = [device.index] if cuda else None
        with torch.device(device):                # initialised on the GPU: seconds less per mode for 355M
            model = MODELS[args.model].build()
        self.num_params = sum(p.numel() for p in model.parameters())
        self.device = device
        self.ddp = None
        if mode.startswith("torch DDP"):
            model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=torch_pg,
                                                        gradient_as_bucket_view=bool(grad_view))
        elif mode.startswith("pynccl"):
            prio0 = mode.startswith(COMM_PRIO0) or mode.startswith(ALL_PRIO0)
            kwargs = {} if grad_view is None else dict(gradient_as_bucket_view=grad_view)
            if lever is not None:
                kwargs.update(lever.ddp_kwargs)
            model = self.ddp = pynccl.DistributedDataParallel(
                model, device_ids=device_ids, process_group=args.prio0_group if prio0 else group, **kwargs)
            if mode.startswith(ALL_PRIO0):
                self.ddp.reducer.pack_stream = torch.cuda.Stream(device)
            # The default hook, as a user has it: a bucket is one C++ call, except in the
            # PY_PATH mode, which runs the same streams and kernels through Python.
            self.ddp.reducer.allow_fused = PY_PATH not in mode
            if lever is not None:
                lv.apply(self.ddp, lever)
        self.model = model
        self.hidden_comm = None
        if mode == ORACLE:
            per = ORACLE_BUCKET_BYTES // 4
            n = self.num_params
            self.comm_group = group if group is not None else pynccl.get_default_group()
            sizes = [(min(per, n - i), torch.float32) for i in range(0, n, per)]
            # The bound of the path pynccl DDP takes by default: its buckets' symmetric window where
            # there is one (comm/symmetric.py), else ordinary tensors.
            self.hidden_comm = alloc_symmetric(self.comm_group, sizes) if cuda else None
            if self.hidden_comm is None:
                self.hidden_comm = [torch.zeros(k, device=device) for k, _ in sizes]
        self.opt = make_optimizer(model, device)
        if lever is not None and lever.overlap_optimizer:
            self.ddp.overlap_optimizer(self.opt)
        self.x, self.y = batch
        self.autocast = args.precision == "bf16"
        self.graph = None
        if "+ graph" in mode:
            self._capture()

    def forward_loss(self):
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast, cache_enabled=False):
            return self.model(self.x, self.y)

    def eager_step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        works = self._start_hidden_comm()
        loss.backward()
        for w in works:
            w.wait()
        self.opt.step()
        return loss

    def _start_hidden_comm(self):
        """ORACLE: the gradients' bytes all-reduced from backward's start (async, on the communicator's stream)."""
        if self.hidden_comm is None:
            return []
        return [pynccl.all_reduce(t, group=self.comm_group, async_op=True) for t in self.hidden_comm]

    def phase_step(self):
        """One eager step with CUDA events and host clocks between its phases: (GPU ms, host ms)
        per phase (forward incl. zero_grad and loss, backward incl. DDP's end-of-backward work, optimizer)."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        host = [0.0] * 4
        ev[0].record()
        host[0] = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        ev[1].record()
        host[1] = time.perf_counter()
        works = self._start_hidden_comm()
        with self._backward_events() as marks:
            loss.backward()
        for w in works:
            w.wait()
        ev[2].record()
        host[2] = time.perf_counter()
        self.opt.step()
        ev[3].record()
        host[3] = time.perf_counter()
        return ev, host, marks

    @contextlib.contextmanager
    def _backward_events(self):
        """pynccl DDP only: CUDA events inside its backward, for where the backward phase's time goes.
        marks["compute"]: on the compute stream when the reducer's end-of-backward callback starts (so
        it completes with the last compute kernel); ["written"] after the write-back (the compute stream
        waited for every bucket's reduction); ["end"] after the tied rows' exchange; ["buckets"]: per
        bucket in hand-out order, (index, event when its gradients are ready on the compute stream,
        event when its reduction ends on the communicator's stream)."""
        marks = {"buckets": []}
        r = self.ddp.reducer if self.ddp is not None else None
        if r is None or r.fused_comm is None:
            yield marks
            return
        bucketer = r.bucketer
        comm_stream = torch.cuda.ExternalStream(r.fused_comm.stream_handle)

        def event(stream=None):
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            return e

        ready, end, write_back = bucketer.on_bucket_ready, bucketer.on_backward_end, r._write_back_all

        def on_ready(b):
            mark = event()
            ready(b)
            marks["buckets"].append((b.index, mark, event(comm_stream)))

        def on_end():
            marks["compute"] = event()
            end()
            marks["end"] = event()

        def written():
            write_back()
            marks["written"] = event()

        bucketer.on_bucket_ready, bucketer.on_backward_end, r._write_back_all = on_ready, on_end, written
        try:
            yield marks
        finally:
            bucketer.on_bucket_ready, bucketer.on_backward_end = ready, end
            del r._write_back_all

    def _capture(self):
        # Eager warm-up on a side stream builds, then rebuilds, the buckets (see pynccl/ddp/module.py).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.eager_step()
        torch.cuda.current_stream().wait_stream(side)
        self.opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            loss = self.forward_loss()
            loss.backward()
            self.opt.step()

    def step(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.eager_step()

    def profile_buckets(self):
        """One eager step: GPU time from backward's start at which each bucket became ready (its
        last gradient made, on the compute stream), and backward's length (the end includes
        waiting for and unpacking the buckets)."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_loss()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events = []
        bucketer = self.ddp.reducer.bucketer
        on_ready = bucketer.on_bucket_ready

        def timed_on_ready(b):                      # benchmark-only: an event where the bucket is handed on
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.append((b.index, ev))
            on_ready(b)

        bucketer.on_bucket_ready = timed_on_ready
        try:
            start.record()
            loss.backward()
            end.record()
            torch.cuda.synchronize()
        finally:
            bucketer.on_bucket_ready = on_ready
        ready = {i: start.elapsed_time(ev) for i, ev in events}
        self.opt.zero_grad(set_to_none=True)
        return ready, start.elapsed_time(end)
