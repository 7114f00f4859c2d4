"""FSDP2 as torchtitan applies it to a decoder (torchtitan/distributed/fsdp.py,
apply_fsdp_to_decoder, at pytorch/torchtitan b5bcd76), on an HF LlamaForCausalLM / GPT2LMHeadModel:

  untied (Llama)  fully_shard(embedding); fully_shard([final norm, LM head],
                  reshard_after_forward=False) (backward needs them first, so gathering them again
                  would be wasted); fully_shard(block) for each block; fully_shard(model) (the root)
  tied (GPT-2)    fully_shard([token and position embeddings, final norm, LM head],
                  reshard_after_forward=False) (the shared weight is gathered once); the blocks;
                  the root
MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=False), as torchtitan. The
blocks are compiled before this (compile_recipes.compile_blocks), as torchtitan compiles before
apply_fsdp. reshard_after_forward=False everywhere is ZeRO-2's counterpart: parameters gathered
once per step and kept through backward, gradients reduce-scattered.
"""
from __future__ import annotations

import torch

from .compile_recipes import blocks_of


def mixed_precision(ctx):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if not ctx.bf16:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def titan_fully_shard(model, mesh, mp_policy, reshard_after_forward: bool = True):
    """Shard `model` in place, torchtitan's way (see the module docstring); returns it."""
    from torch.distributed.fsdp import fully_shard
    kw = dict(mesh=mesh)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if hasattr(model, "model"):                      # Llama: untied embedding and head
        fully_shard(model.model.embed_tokens, reshard_after_forward=reshard_after_forward, **kw)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False, **kw)
    else:                                            # GPT-2: wte tied to lm_head
        t = model.transformer
        fully_shard([t.wte, t.wpe, t.ln_f, model.lm_head], reshard_after_forward=False, **kw)
    for block in blocks_of(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    return model
