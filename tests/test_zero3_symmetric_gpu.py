"""ZeRO-3's gather ring in a real NCCL symmetric window (issue 26 item 2), 2 GPUs: with the ring
(PYNCCL_ZERO3_SYMMETRIC=1) training equals training without it (=0) bit for bit: the gathers
move the same bytes and every GEMM reads the same values at the same alignment class (ring
slots and caching-allocator blocks are both 512-byte aligned, and a parameter's offset in its
unit is the same). Losses and parameters after SGD and AdamW steps, fp32 and bf16 mixed
precision, with Hugging Face gradient checkpointing; eager attention and deterministic
algorithms, so two runs of either kind are themselves repeatable. The profiler shows the block
gathers are no longer NCCL's all-gather kernels: on the copy engines (CTAPolicy ZERO, NCCL >=
2.28) no kernel at all, else NCCL's symmetric kernels; only the root unit (Llama's final
norm, outside the ring) keeps its one default all-gather a step."""
import gc
import os

import pytest
import torch

import pynccl
from pynccl.comm.symmetric import window_bytes
from pynccl.testing import run_multiprocess
from pynccl.zero.gather_ring import GATHER_SLOTS

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_NVLS_ENABLE": "0"}


def _llama(checkpointing):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                                   tie_word_embeddings=False, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    return model.cuda().train()


def _train(ring, optim, mixed, checkpointing, steps=3, profile=False):
    from pynccl.zero import MixedPrecision
    os.environ["PYNCCL_ZERO3_SYMMETRIC"] = "1" if ring else "0"
    rank = pynccl.get_rank()
    mp = MixedPrecision(torch.bfloat16, torch.float32) if mixed else None
    gc.collect()                                       # an earlier case's window goes first
    windows_before = window_bytes()
    model = pynccl.FullyShardedDataParallel(_llama(checkpointing), stage=3, mixed_precision=mp)
    rt = model._runtime
    assert (rt.gather_ring is not None) == ring, rt.gather_ring_reason
    # The ring's window, counted where torch's allocator statistics miss it: GATHER_SLOTS slots of the
    # largest block's gathered bytes, each 4096-aligned (none without the ring).
    slot = max(u.layout.padded_numel * u.full.element_size() for u in rt.units if u is not rt.root)
    expected = GATHER_SLOTS * (-(-slot // 4096) * 4096) if ring else 0
    assert window_bytes() - windows_before == expected, (window_bytes(), windows_before, slot)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optim == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator("cuda").manual_seed(100 + rank)
    losses, names = [], []
    for step in range(steps):
        ids = torch.randint(0, 512, (4, 128), device="cuda", generator=g)
        prof = None
        if profile and step == steps - 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        losses.append(loss.detach())
    params = [t.clone() for t in model.full_state_dict().values()]
    stats = None
    if rt.gather_ring is not None:
        stats = (rt.gather_ring.gathers, rt.gather_ring.spilled)
        assert all(o is None for o in rt.gather_ring.occupants)
    return losses, params, names, stats, rt.root is not None


def _ring_equals_plain(rank, ws, cases):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    from pynccl.comm.symmetric import symmetric_support
    support = symmetric_support(pynccl.get_default_group())
    assert support.available, support.reason
    report = []
    for optim, mixed, checkpointing in cases:
        what = f"{optim} bf16={mixed} checkpointing={checkpointing}"
        plain = _train(False, optim, mixed, checkpointing, profile=True)
        ringed = _train(True, optim, mixed, checkpointing, profile=True)
        for a, b in zip(plain[0], ringed[0]):
            assert torch.equal(a, b), f"{what}: losses {[x.item() for x in plain[0]]} != {[x.item() for x in ringed[0]]}"
        for a, b in zip(plain[1], ringed[1]):
            assert torch.equal(a, b), f"{what}: parameters differ"
        gathers, spilled = ringed[3]
        assert gathers > 0 and spilled == 0, (what, gathers, spilled)
        default_ag = [n for n in ringed[2] if n.startswith("ncclDevKernel_AllGather")]
        plain_ag = [n for n in plain[2] if n.startswith("ncclDevKernel_AllGather")]
        root_gathers = 1 if ringed[4] else 0          # the root unit: one ordinary gather a step
        assert len(plain_ag) > 2 * root_gathers, plain_ag      # the check would see default all-gathers
        assert len(default_ag) == root_gathers, default_ag
        if not support.copy_engine:
            assert any("ncclSymk" in n for n in ringed[2]), sorted(set(ringed[2]))
        report.append((what, len(plain_ag), len(default_ag), gathers))
    return support.describe(), report


@pytest.mark.multigpu
@needs_2_gpus
def test_zero3_ring_equals_plain_and_leaves_nccl_all_gather_kernels():
    cases = [("sgd", False, None), ("adamw", False, False), ("sgd", True, True), ("adamw", True, False)]
    out = run_multiprocess(_ring_equals_plain, 2, backend="nccl", start_method="spawn", timeout=500,
                           args=(cases,), env=DETERMINISTIC)
    support, report = out[0]
    print(f"symmetric memory: {support}")
    for what, plain_ag, ring_ag, gathers in report:
        print(f"{what}: default all-gather kernels in one step {plain_ag} -> {ring_ag}; ring gathers {gathers}")
