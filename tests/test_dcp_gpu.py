"""ZeRO-3 on NCCL and torch's FSDP2 (fully_shard on CUDA) through torch.distributed.checkpoint, on
2 GPUs: pynccl saves, FSDP2 loads (weights and AdamW state bit for bit), both train on alike;
FSDP2 saves, ZeRO-3 and ZeRO-1 load it bit for bit; FSDP2's in-memory state dict (DTensors on
the same ranks) loads straight into ZeRO-3. pynccl.zero.save_pretrained of a ZeRO-3 Hugging Face
model raises the peak CUDA memory by at most the largest unit's gathered buffer.

The FSDP2 mesh is made from pynccl's torch group (pynccl.to_torch_group), which carries NCCL for
CUDA tensors whatever torch's default group is.
"""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions

import pynccl
from pynccl import zero
from pynccl.testing import run_multiprocess
from test_dcp import assert_equal_nested, get_sd, load, run_steps, whole
from test_zero import LR, STEPS, make_net

SAVED_AT = 2
FULL = StateDictOptions(full_state_dict=True)
# fp32 with TF32 off; both runs start from the same bits, then average gradients in another order
# (pynccl's ReduceOp.AVG reduce-scatter vs FSDP2's): the bound test_zero_gpu.py holds ZeRO to
# against a single process after 5 steps.
LOSS_TOL = 1e-5


def _fsdp2(device):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    net = make_net().to(device)
    mesh = DeviceMesh.from_group(pynccl.to_torch_group(None), "cuda")
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=LR)


def _zero(stage):
    model = pynccl.FullyShardedDataParallel(make_net(), stage=stage, bucket_cap_mb=0.0005)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _devices(sd, path="") -> dict:
    """path -> device type of every tensor in a nested state dict."""
    if isinstance(sd, dict):
        return {k: v for key, item in sd.items() for k, v in _devices(item, f"{path}/{key}").items()}
    if isinstance(sd, list):
        return {k: v for i, item in enumerate(sd) for k, v in _devices(item, f"{path}/{i}").items()}
    return {path: sd.device.type} if isinstance(sd, torch.Tensor) else {}


def _interop(rank, ws, root):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = pynccl.get_device()
    torch.cuda.set_device(device)
    # pynccl ZeRO-3 -> DCP -> FSDP2
    model, opt = _zero(3)
    run_steps(model, opt, range(SAVED_AT), rank, ws, device)
    assert model.state_dict()["emb.weight"].to_local().is_cuda
    offloaded = zero.get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    assert offloaded["emb.weight"].to_local().device.type == "cpu", "cpu_offload keeps DTensors, on CPU"
    dcp.save(get_sd(model, opt), checkpoint_id=os.path.join(root, "zero3"))
    saved = whole(get_sd(model, opt, FULL))
    net, net_opt = _fsdp2(device)
    load(net, net_opt, os.path.join(root, "zero3"))
    assert_equal_nested(whole(get_sd(net, net_opt, FULL)), saved, "zero3 -> FSDP2")
    for options in (FULL, StateDictOptions(full_state_dict=True, cpu_offload=True)):
        ours, theirs = _devices(get_sd(model, opt, options)), _devices(get_sd(net, net_opt, options))
        assert ours == theirs, f"{options}: devices of the full state dicts differ from FSDP2's: {ours} vs {theirs}"
    ours = run_steps(model, opt, range(SAVED_AT, STEPS), rank, ws, device)
    theirs = run_steps(net, net_opt, range(SAVED_AT, STEPS), rank, ws, device)
    torch.testing.assert_close(torch.tensor(theirs), torch.tensor(ours), rtol=0, atol=LOSS_TOL,
                               msg=lambda m: f"FSDP2 resumed {theirs} vs ZeRO-3 {ours}: {m}")
    # FSDP2 -> DCP -> pynccl ZeRO-3 and ZeRO-1
    dcp.save(get_sd(net, net_opt), checkpoint_id=os.path.join(root, "fsdp2"))
    saved = whole(get_sd(net, net_opt, FULL))
    for stage in (3, 1):
        fresh, fresh_opt = _zero(stage)
        load(fresh, fresh_opt, os.path.join(root, "fsdp2"))
        assert_equal_nested(whole(get_sd(fresh, fresh_opt, FULL)), saved, f"FSDP2 -> ZeRO-{stage}")
    # In memory: FSDP2's DTensors load as they are.
    fresh, fresh_opt = _zero(3)
    fresh.load_state_dict(net.state_dict())
    assert_equal_nested(fresh.full_state_dict(), saved["model"], "FSDP2 state_dict() -> ZeRO-3 load_state_dict")
    return True


def _save_pretrained_memory(rank, ws, root):
    transformers = pytest.importorskip("transformers")
    device = pynccl.get_device()
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = pynccl.FullyShardedDataParallel(transformers.LlamaForCausalLM(cfg), stage=3)
    largest = max(u.layout.padded_numel * u.shard.element_size() for u in model.units)
    total = sum(u.layout.padded_numel * u.shard.element_size() for u in model.units)
    assert total > 4 * largest, (largest, total)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    zero.save_pretrained(model, os.path.join(root, "hf"))
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated(device) - before
    # One unit's full buffer, plus the allocator's rounding (512-byte blocks; 2 MiB covers it).
    assert grown <= largest + 2 * 2**20, f"rank {rank}: peak grew by {grown} bytes, one unit is {largest}"
    full = model.full_state_dict()
    if rank == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(root, "hf"))
        assert_equal_nested({k: v.detach() for k, v in loaded.state_dict().items()}, full, "save_pretrained")
    return True


def _case(rank, ws, root):
    return _interop(rank, ws, root) and _save_pretrained_memory(rank, ws, root)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_zero3_and_fsdp2_through_dcp_on_two_gpus(tmp_path):
    assert run_multiprocess(_case, 2, backend="nccl", start_method="spawn", args=(str(tmp_path),),
                            timeout=600) == [True, True]
