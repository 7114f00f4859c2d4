"""Tensor parallelism's batch-chunked overlap (pynccl/tensor_parallel/batch_overlap.py,
PYNCCL_TP_BATCH_CHUNKS=k), on Hugging Face models by plan, gloo, TP 2:

* loss, logits and every gradient equal the unsharded model's within the fp32 rounding of its
  reductions (tests/test_tp_plan.py's check_plan and bound), for Llama (bias-free row-parallel
  layers: forward all-reduces deferred) and GPT-2 (biased Conv1D: forward synchronous, backward
  chunked), with both kinds of activation checkpointing, at 2 chunks of a batch of 2;
* the collectives really go per chunk: forward defers k all-reduces per block; backward starts
  chunk k-1's input-gradient all-reduce before chunk k-2's backward GEMMs run;
* a block that changes its row-parallel layer's output before returning it raises (that op would
  read a sum not yet complete on a GPU);
* off where it cannot act: sequence parallelism, a batch k does not divide, a KV cache (attention
  stays whole, the MLP is chunked), PYNCCL_TP_BATCH_CHUNKS unset or 1; the switch is checked."""
import os

import pytest
import torch
import torch.nn as nn

import pynccl.tensor_parallel as tp
from pynccl.tensor_parallel import batch_overlap
from pynccl.testing import run_multiprocess

transformers = pytest.importorskip("transformers")

from test_tp_plan import BATCH, build, check_plan, gpt2_config, llama_config, tokens  # noqa: E402

assert BATCH == 2  # two chunks of one sequence each below


class _Chunks:
    """PYNCCL_TP_BATCH_CHUNKS=k inside the block, and counts of what the overlap did."""

    def __init__(self, k):
        self.k, self.deferred, self.started, self.joined = k, 0, 0, 0

    def __enter__(self):
        os.environ[batch_overlap.ENV] = str(self.k)
        self._orig = (batch_overlap.reduce_deferred, batch_overlap._StartInputGradSum.backward,
                      batch_overlap._SplitBatch.backward)
        reduce_deferred, start, join = self._orig

        def counted_reduce(y, group):
            self.deferred += 1
            return reduce_deferred(y, group)

        def counted_start(ctx, grad):
            self.started += 1
            return start(ctx, grad)

        def counted_join(ctx, *grads):
            self.joined += 1
            return join(ctx, *grads)
        batch_overlap.reduce_deferred = counted_reduce
        batch_overlap._StartInputGradSum.backward = staticmethod(counted_start)
        batch_overlap._SplitBatch.backward = staticmethod(counted_join)
        return self

    def __exit__(self, *exc):
        os.environ.pop(batch_overlap.ENV, None)
        batch_overlap.reduce_deferred = self._orig[0]
        batch_overlap._StartInputGradSum.backward = staticmethod(self._orig[1])
        batch_overlap._SplitBatch.backward = staticmethod(self._orig[2])


def _equal_to_unsharded(rank, ws):
    # (what, config, plan, checkpointing, blocks run per chunk, of which with a bias-free row-parallel layer)
    # 2 layers x (attention + MLP). With a KV cache (use_cache, the config's default) attention
    # stays whole: each chunk would extend the cache as if it were the next tokens.
    cases = [("llama", llama_config(use_cache=False), tp.plans.llama(), False, 4, 4),
             ("llama, no loss parallel", llama_config(use_cache=False), tp.plans.llama(loss_parallel=False), False,
              4, 4),
             ("llama, checkpointed", llama_config(use_cache=False), tp.plans.llama(), True, 4, 4),
             ("llama with a KV cache", llama_config(use_cache=True), tp.plans.llama(), False, 2, 2),
             ("gpt2 (biased row-parallel Conv1D)", gpt2_config(use_cache=False), tp.plans.gpt2(), False, 4, 0)]
    for what, config, plan, ckpt, blocks, deferring_blocks in cases:
        with _Chunks(2) as seen:
            check_plan(config, plan, None, f"{what}, 2 batch chunks", checkpointing=ckpt)
        expected = {2 * deferring_blocks}
        if ckpt:   # a checkpointed layer's forward runs again in backward; torch's non-reentrant recompute
            # stops once it has every saved tensor it needs, before each layer's last down_proj (2 layers)
            expected = {4 * deferring_blocks, 4 * deferring_blocks - 2}
        assert seen.deferred in expected, f"{what}: {seen.deferred} deferred all-reduces, expected {expected}"
        assert seen.started == 2 * blocks, f"{what}: {seen.started} input-gradient all-reduces started per chunk"
        assert seen.joined == blocks, f"{what}: {seen.joined} joins"
    return True


def _reentrant_checkpoint(rank, ws):
    """torch's reentrant checkpoint: the recompute runs inside the checkpoint's backward."""
    def close(actual, expected, what, tol):
        from test_tp_plan import _close
        _close(actual, expected, what, tol)
    with _Chunks(2):
        ref = build(llama_config(use_cache=False))
        par = tp.parallelize_module(build(llama_config(use_cache=False)), None, tp.plans.llama())
        par.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        par.train()
        x = tokens()
        ref(input_ids=x, labels=x).loss.backward()
        par(input_ids=x, labels=x).loss.backward()
    from test_tp_plan import FP32_TOL
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        close(p.grad, tp.shard_like(p, ref_params[name].grad, None), f"reentrant: grad of {name}", FP32_TOL)
    return True


def _padding_mask(rank, ws):
    """A padded batch: the attention mask's dim 0 is the batch, so each chunk takes its own rows."""
    from test_tp_plan import FP32_TOL, _close
    config = llama_config(use_cache=False)
    ref = build(config)
    par = tp.parallelize_module(build(config), None, tp.plans.llama())
    x = tokens()
    mask = torch.ones_like(x)
    mask[1, :3] = 0                               # the second sequence is left-padded
    labels = x.masked_fill(mask == 0, -100)
    ref_out = ref(input_ids=x, attention_mask=mask, labels=labels)
    ref_out.loss.backward()
    with _Chunks(2) as seen:
        out = par(input_ids=x, attention_mask=mask, labels=labels)
        out.loss.backward()
    assert seen.started == 8, vars(seen)
    _close(out.loss, ref_out.loss.detach(), "padded: loss", FP32_TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        _close(p.grad, tp.shard_like(p, ref_params[name].grad, None), f"padded: grad of {name}", FP32_TOL)
    return True


def _copy_engine_path_on_gloo(rank, ws):
    """The copy-engine variant's bookkeeping (gather into per-chunk buffers, sum after the wait, the
    join summing the gathered input gradients) on gloo, with plain CPU buffers standing in for the
    symmetric windows: equal to the unsharded model; a later, smaller batch reuses the buffers'
    leading elements, a larger one takes the all-reduce instead of another window."""
    from test_tp_plan import FP32_TOL, _close
    allocations = []

    def fake_alloc(group, sizes):
        allocations.append(sizes)
        return [torch.full((numel,), float("nan"), dtype=dtype) for numel, dtype in sizes]
    originals = batch_overlap._copy_engine, batch_overlap.alloc_symmetric
    batch_overlap._copy_engine = lambda group: True
    batch_overlap.alloc_symmetric = fake_alloc
    try:
        config = llama_config(use_cache=False)
        par = tp.parallelize_module(build(config), None, tp.plans.llama())
        ref = build(config)
        ref_params = dict(ref.named_parameters())
        for batch in (4, 2, 6):                   # chunks of 2, then 1 (fits), then 3 (does not fit)
            x = torch.randint(0, 128, (batch, 8), generator=torch.Generator().manual_seed(batch))
            for m in (ref, par):
                m.zero_grad()
            ref_out = ref(input_ids=x, labels=x)
            ref_out.loss.backward()
            with _Chunks(2) as seen:
                out = par(input_ids=x, labels=x)
                out.loss.backward()
            assert seen.started == 8 and seen.deferred == 8, vars(seen)
            _close(out.loss, ref_out.loss.detach(), f"batch {batch}: loss", FP32_TOL)
            for name, p in par.named_parameters():
                _close(p.grad, tp.shard_like(p, ref_params[name].grad, None), f"batch {batch}: grad of {name}",
                       FP32_TOL)
            # one window per (forward / backward, chunk): 4, made by the first batch only
            assert len(allocations) == 4, (batch, allocations)
    finally:
        batch_overlap._copy_engine, batch_overlap.alloc_symmetric = originals
    return True


def _backward_order(rank, ws):
    """In each attention block's backward: chunk 1's q_proj GEMMs, chunk 1's all-reduce start,
    then chunk 0's q_proj GEMMs (beside that all-reduce), chunk 0's start, the join."""
    log = []
    model = tp.parallelize_module(build(llama_config(use_cache=False)), None, tp.plans.llama())
    for layer in model.model.layers:
        layer.self_attn.q_proj.register_full_backward_hook(lambda *a: log.append("q_proj"))
    with _Chunks(2):
        start, join = batch_overlap._StartInputGradSum.backward, batch_overlap._SplitBatch.backward
        batch_overlap._StartInputGradSum.backward = staticmethod(lambda ctx, g: (log.append("start"), start(ctx, g))[1])
        batch_overlap._SplitBatch.backward = staticmethod(lambda ctx, *g: (log.append("join"), join(ctx, *g))[1])
        x = tokens()
        model(input_ids=x, labels=x).loss.backward()
    attention = ["q_proj", "start", "q_proj", "start", "join"]
    mlp = ["start", "start", "join"]
    assert log == (mlp + attention) * 2, log      # layer 1's MLP, its attention, then layer 0's
    return True


class _Doubling(nn.Module):
    """A block that scales its row-parallel layer's output before returning it."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(self.up(x)) * 2


def _raises_on_a_changed_output(rank, ws):
    torch.manual_seed(0)
    model = nn.Sequential(_Doubling())
    plan = {"0": tp.PrepareModuleInput(input_layouts=(tp.Replicate(),), desired_input_layouts=(tp.Replicate(),)),
            "0.up": tp.ColwiseParallel(), "0.down": tp.RowwiseParallel()}
    model = tp.parallelize_module(model, None, plan)
    x = torch.randn(4, 3, 8, requires_grad=True)
    with _Chunks(2):
        with pytest.raises(RuntimeError, match="did not return that layer's output unchanged"):
            model(x)
    y = model(x)                                  # off: the plain path
    assert y.shape == (4, 3, 8)
    return True


def _off_where_it_cannot_act(rank, ws):
    cases = [("sequence parallel", tp.plans.llama(sequence_parallel=True), 2),
             ("a batch of 2 in 4 chunks", tp.plans.llama(), 4)]
    for what, plan, k in cases:
        with _Chunks(k) as seen:
            check_plan(llama_config(use_cache=False), plan, None, what)
        assert (seen.deferred, seen.started, seen.joined) == (0, 0, 0), f"{what}: the overlap acted"
    with _Chunks(1) as seen:
        check_plan(llama_config(use_cache=False), tp.plans.llama(), None, "1 chunk")
    assert (seen.deferred, seen.started, seen.joined) == (0, 0, 0)
    return True


@pytest.mark.numerics
def test_chunked_blocks_equal_the_unsharded_model():
    assert run_multiprocess(_equal_to_unsharded, 2, backend="gloo", timeout=240) == [True, True]


@pytest.mark.numerics
def test_copy_engine_bookkeeping_equals_the_unsharded_model():
    assert run_multiprocess(_copy_engine_path_on_gloo, 2, backend="gloo", timeout=120) == [True, True]


@pytest.mark.numerics
def test_chunked_blocks_with_a_padding_mask():
    assert run_multiprocess(_padding_mask, 2, backend="gloo", timeout=120) == [True, True]


@pytest.mark.numerics
def test_chunked_blocks_under_reentrant_checkpointing():
    assert run_multiprocess(_reentrant_checkpoint, 2, backend="gloo", timeout=120) == [True, True]


def test_backward_starts_a_chunk_before_the_next_chunks_gemms():
    assert run_multiprocess(_backward_order, 2, backend="gloo", timeout=120) == [True, True]


def test_a_block_changing_the_deferred_output_raises():
    assert run_multiprocess(_raises_on_a_changed_output, 2, backend="gloo", timeout=120) == [True, True]


@pytest.mark.numerics
def test_off_where_it_cannot_act():
    assert run_multiprocess(_off_where_it_cannot_act, 2, backend="gloo", timeout=240) == [True, True]


def test_switch_is_checked(monkeypatch):
    monkeypatch.delenv(batch_overlap.ENV, raising=False)
    assert batch_overlap.chunks_requested() == 1
    monkeypatch.setenv(batch_overlap.ENV, "4")
    assert batch_overlap.chunks_requested() == 4
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv(batch_overlap.ENV, bad)
        with pytest.raises(ValueError, match="PYNCCL_TP_BATCH_CHUNKS must be an integer >= 1"):
            batch_overlap.chunks_requested()

    class Gloo:
        backend_name = "gloo"
    monkeypatch.delenv(batch_overlap.CE_ENV, raising=False)
    assert not batch_overlap._copy_engine(Gloo())  # the all-reduce unless asked (measured faster, RESULTS)
    monkeypatch.setenv(batch_overlap.CE_ENV, "1")
    assert not batch_overlap._copy_engine(Gloo())  # no symmetric memory off NCCL
    monkeypatch.setenv(batch_overlap.CE_ENV, "yes")
    with pytest.raises(ValueError, match="PYNCCL_TP_BATCH_COPY_ENGINE must be 0 or 1"):
        batch_overlap._copy_engine(Gloo())


def _gpu_equal_to_unsharded(rank, ws):
    """On NCCL a missing wait is a race, not a no-op (gloo's all-reduce completes inside the call):
    a Llama big enough that each chunk's collectives overlap the next chunk's GEMMs, fp32 against the
    unsharded model on the same GPU, within the rounding of its reductions (numerics.transformer_rtol)."""
    import pynccl
    from numerics import transformer_rtol
    from test_tp_plan import _close
    dev = pynccl.get_device(pynccl.get_default_group())
    batch, seq, hidden, ffn, layers, vocab = 4, 256, 512, 1536, 2, 1024
    config = llama_config(heads=8, kv_heads=4, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                          vocab_size=vocab, max_position_embeddings=seq, use_cache=False)
    tol = transformer_rtol(layers, hidden, ffn, hidden // 8, seq, vocab, batch * seq)
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(dev)
    ref = build(config).to(dev)
    ref(input_ids=x, labels=x).loss.backward()
    ref_params = dict(ref.named_parameters())
    from pynccl.comm.symmetric import symmetric_support
    group = pynccl.get_default_group()
    copy_engine = symmetric_support(group).copy_engine
    for k, ce in ((2, "1"), (4, "1"), (2, "0")):
        par = tp.parallelize_module(build(config).to(dev), None, tp.plans.llama())
        os.environ[batch_overlap.CE_ENV] = ce
        try:
            with _Chunks(k) as seen:
                out = par(input_ids=x, labels=x)
                out.loss.backward()
        finally:
            os.environ.pop(batch_overlap.CE_ENV, None)
        assert seen.started == k * 2 * layers and seen.deferred == k * 2 * layers, (k, vars(seen))
        slots = getattr(group, batch_overlap._SLOTS_ATTR, {})
        if ce == "1" and copy_engine:             # the copy-engine gathers ran: their buffers exist
            assert len([key for key, v in slots.items() if v is not None and key[1] == k - 1]) == 2, slots.keys()
        if rank == 0:
            print(f"{k} chunks, copy engine {ce == '1' and copy_engine} ({symmetric_support(group).describe()})")
        _close(out.loss, ref(input_ids=x, labels=x).loss.detach(), f"{k} chunks: loss", tol)
        for name, p in par.named_parameters():
            _close(p.grad, tp.shard_like(p, ref_params[name].grad, None), f"{k} chunks: grad of {name}", tol)
    return True


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_chunked_blocks_equal_the_unsharded_model_nccl():
    assert run_multiprocess(_gpu_equal_to_unsharded, 2, backend="nccl", start_method="spawn", timeout=300) == \
        [True, True]
