"""Hugging Face models checkpointed through torch.distributed.checkpoint across parallel layouts,
on gloo: saved at world size 2 from ZeRO-3, tensor parallelism (Llama by plan; GPT-2, whose fused
q|k|v and Conv1D shard dim 1 take the all_to_all regrouping) and a 2-stage pipeline; loaded at
world size 3 into TP 3, ZeRO stages 1 and 3 and a 3-stage pipeline with other boundaries. Every
load must give back the saved tensors bit for bit (weights, and optimizer state where the layout
keeps it), and dcp_to_torch_save must give a state dict the plain HF model loads strictly with
the same weights.

pynccl.zero.save_pretrained of a ZeRO-3 model: from_pretrained loads the same weights, and while
saving no rank ever held more gathered elements at once than the largest unit (counted on every
gather), and ranks other than 0 kept none on CPU.
"""
import os
import time
import weakref

import pytest
import torch
import torch._dynamo  # noqa: F401  the first optimizer.step() imports it: do it once, before ranks fork
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as tsd
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions

import pynccl
import pynccl.tensor_parallel as tp
from pynccl import zero
from pynccl.pipeline import hf_stage_modules
from pynccl.pipeline.state_dict import to_model_keys, to_stage_keys
from pynccl.testing import run_multiprocess
from test_dcp import assert_equal_nested, read_whole, whole

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 96, 8, 6
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg)


def tokens(step, rank=0, ws=1):
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    n = BATCH // ws
    return x[rank * n:(rank + 1) * n]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def step(model, opt, x):
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def save_full(obj, root, name):
    if pynccl.get_rank() == 0:
        torch.save(obj, os.path.join(root, name + ".pt"))
    pynccl.barrier()


def load_full(root, name):
    return torch.load(os.path.join(root, name + ".pt"), weights_only=False)


def cpu(sd):
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


# ---------------------------------------------------------------------- world size 2: save
def _zero3(rank, ws, root):
    model = pynccl.FullyShardedDataParallel(llama(), stage=3)
    opt = adamw(model.parameters())
    step(model, opt, tokens(0, rank, ws))
    dcp.save({"model": model.state_dict(), "optim": zero.get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(root, "zero3"))
    save_full(model.full_state_dict(), root, "zero3_full")
    # save_pretrained, counting the gathered elements alive at any time on this rank.
    import pynccl.zero.state_dict as zsd
    live, peak, kept = {}, [0], []
    real_gather, real_split = zsd._gather_flat, zsd.split_flat

    def counting_gather(*args):
        # NOTE: gloo's worker thread may still hold the last collective's output for a moment after
        # it completed (torch keeps the Python tensor alive meanwhile): wait for that, not longer.
        deadline = time.monotonic() + 5.0
        while live and time.monotonic() < deadline:
            time.sleep(0.005)
        flat = real_gather(*args)
        live[id(flat)] = flat.numel()
        weakref.finalize(flat, live.pop, id(flat))
        peak[0] = max(peak[0], sum(live.values()))
        return flat

    zsd._gather_flat = counting_gather
    zsd.split_flat = lambda *a: kept.append(1) or real_split(*a)
    try:
        zero.save_pretrained(model, os.path.join(root, "hf"))
    finally:
        zsd._gather_flat, zsd.split_flat = real_gather, real_split
    largest = max(u.layout.padded_numel for u in model.units)
    total = sum(u.layout.padded_numel for u in model.units)
    assert len(model.units) >= 4 and largest < total / 2, (largest, total)
    assert 0 < peak[0] <= largest, f"rank {rank}: {peak[0]} gathered elements alive at once, one unit is {largest}"
    assert (len(kept) > 0) == (rank == 0), f"rank {rank} copied {len(kept)} units to CPU"


def _tp_save(rank, ws, root, name, build, plan):
    model = tp.parallelize_module(build(), None, plan)
    opt = adamw(model.parameters())
    step(model, opt, tokens(1))
    dcp.save({"model": tp.sharded_state_dict(model), "optim": tp.sharded_optim_state_dict(model, opt)},
             checkpoint_id=os.path.join(root, name))
    save_full(cpu(tp.unsharded_state_dict(model)), root, name + "_full")


def _stage_loss(stage, rank, x):
    hidden = x if rank == 0 else torch.randn(x.shape + (48,), generator=torch.Generator().manual_seed(rank))
    return stage(hidden).float().square().mean()


def _pp_save(rank, ws, root):
    model = llama()
    stage = hf_stage_modules(model, rank, ws)[0]
    opt = adamw(stage.parameters())
    _stage_loss(stage, rank, tokens(2)).backward()
    opt.step()
    sd = {"model": to_model_keys(stage.state_dict(), stage, model),
          "optim": to_model_keys(tsd.get_optimizer_state_dict(stage, opt, options=FLAT), stage, model)}
    dcp.save(sd, checkpoint_id=os.path.join(root, "pp2"))
    parts = [None] * ws
    pynccl.all_gather_object(parts, whole(sd))
    save_full({k: v for part in parts for k, v in part["model"].items()}, root, "pp2_full")
    save_full({k: v for part in parts for k, v in part["optim"].items()}, root, "pp2_optim_full")


def _save_side(rank, ws, root):
    _zero3(rank, ws, root)
    _tp_save(rank, ws, root, "tp2_llama", llama, tp.plans.llama(loss_parallel=False))
    _tp_save(rank, ws, root, "tp2_gpt2", gpt2, tp.plans.gpt2(loss_parallel=False))
    _pp_save(rank, ws, root)
    return True


# ---------------------------------------------------------------------- world size 3: load
def _into_tp(root, source, build, plan, with_optim):
    model = tp.parallelize_module(build(seed=7), None, plan)
    opt = adamw(model.parameters())
    sd = {"model": tp.sharded_state_dict(model)}
    if with_optim:
        sd["optim"] = tp.sharded_optim_state_dict(model, opt)
    dcp.load(sd, checkpoint_id=os.path.join(root, source))
    tp.load_sharded_state_dict(model, sd["model"])
    assert_equal_nested(cpu(tp.unsharded_state_dict(model)), load_full(root, source + "_full"), f"{source} -> tp3")
    if with_optim:
        tp.load_sharded_optim_state_dict(model, opt, sd["optim"])
        loaded = whole(tp.sharded_optim_state_dict(model, opt))
        assert_equal_nested(loaded, read_whole(os.path.join(root, source), {"optim": loaded})["optim"],
                            f"{source} optimizer -> tp3")


def _into_zero(root, source, stage):
    model = pynccl.FullyShardedDataParallel(llama(seed=7), stage=stage)
    opt = adamw(model.parameters())
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(root, source))
    model.load_state_dict(sd["model"])
    assert_equal_nested(model.full_state_dict(), load_full(root, source + "_full"), f"{source} -> zero{stage} ws3")
    del opt


def _into_pp(rank, ws, root):
    model = llama(seed=7)
    stage = hf_stage_modules(model, rank, ws, boundaries=[1, 2])[0]      # layers [0,1) [1,2) [2,4)
    opt = adamw(stage.parameters())
    sd = {"model": to_model_keys(stage.state_dict(), stage, model),
          "optim": to_model_keys(tsd.get_optimizer_state_dict(stage, opt, options=FLAT), stage, model)}
    dcp.load(sd, checkpoint_id=os.path.join(root, "pp2"))
    stage.load_state_dict(to_stage_keys(sd["model"], stage, model))
    tsd.set_optimizer_state_dict(stage, opt, to_stage_keys(sd["optim"], stage, model), options=FLAT)
    full, optim_full = load_full(root, "pp2_full"), load_full(root, "pp2_optim_full")
    mine = whole({"model": to_model_keys(stage.state_dict(), stage, model),
                  "optim": to_model_keys(tsd.get_optimizer_state_dict(stage, opt, options=FLAT), stage, model)})
    assert mine["model"] and mine["optim"]
    assert_equal_nested(mine["model"], {k: full[k] for k in mine["model"]}, f"pp2 -> pp3 stage {rank}")
    assert_equal_nested(mine["optim"], {k: optim_full[k] for k in mine["optim"]}, f"pp2 optimizer -> pp3 stage {rank}")


def _load_side(rank, ws, root):
    _into_tp(root, "tp2_llama", llama, tp.plans.llama(loss_parallel=False), with_optim=True)
    _into_tp(root, "tp2_gpt2", gpt2, tp.plans.gpt2(loss_parallel=False), with_optim=True)
    _into_tp(root, "zero3", llama, tp.plans.llama(loss_parallel=False), with_optim=False)
    _into_zero(root, "tp2_llama", 3)
    _into_zero(root, "zero3", 1)
    _into_pp(rank, ws, root)
    return True


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp_layouts"))
    assert run_multiprocess(_save_side, 2, args=(root,), timeout=300) == [True] * 2
    return root


def test_load_across_layouts_at_world_size_3(checkpoints):
    assert run_multiprocess(_load_side, 3, args=(checkpoints,), timeout=300) == [True] * 3


@pytest.mark.parametrize("source,build", [("zero3", llama), ("tp2_llama", llama), ("tp2_gpt2", gpt2),
                                          ("pp2", llama)])
def test_dcp_to_torch_save_loads_into_the_hf_model(checkpoints, tmp_path, source, build):
    out = str(tmp_path / "model.pt")
    dcp_to_torch_save(os.path.join(checkpoints, source), out)
    sd = torch.load(out, weights_only=False)["model"]
    model = build(seed=7)
    model.load_state_dict(sd, strict=True)
    assert_equal_nested(cpu(model.state_dict()), load_full(checkpoints, source + "_full"), source)


def test_save_pretrained_loads_with_from_pretrained(checkpoints):
    loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(checkpoints, "hf"))
    assert_equal_nested(cpu(loaded.state_dict()), load_full(checkpoints, "zero3_full"), "save_pretrained")
