"""torch's tensor parallelism of an HF LlamaForCausalLM, as torchtitan writes it for its Llama
(torchtitan/models/llama3/parallelize.py, apply_tp): q/k/v/gate/up ColwiseParallel, o/down
RowwiseParallel, the embedding RowwiseParallel (vocabulary-sharded), the LM head ColwiseParallel
with the logits left sharded on the vocabulary for loss_parallel; with sequence parallelism (as
torchtitan always runs) the norms run SequenceParallel and the attention / MLP inputs are
all-gathered by PrepareModuleInput; without it the norms are replicated (torchtitan's NoParallel).

Two adaptations to HF's code, which derives position ids, the causal mask and the rotary cos/sin
from the embedding output's shape: under sequence parallelism the embedding output and the
residual stream stay DTensors (use_local_output=False), so those shapes are the global ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _no_parallel():
    """torchtitan's NoParallel: the module's parameters become replicated DTensors, its inputs and
    outputs stay local tensors. Without sequence parallelism the norms need it: left plain, their
    weights would sit next to DTensors in one fused/foreach AdamW call, which torch refuses
    ("got mixed torch.Tensor and DTensor"); under FSDP2 they would live on another mesh."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class NoParallel(ParallelStyle):
        def _apply(self, module, device_mesh):
            def to_dtensor(mod, inputs, mesh):
                return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                             if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

            def to_local(mod, outputs, mesh):
                return outputs.to_local() if isinstance(outputs, DTensor) else outputs
            return distribute_module(module, device_mesh, None, input_fn=to_dtensor, output_fn=to_local)
    return NoParallel()


def llama_tp_plan(sequence_parallel: bool):
    """(root plan, per-decoder-layer plan) for torch.distributed.tensor.parallel.parallelize_module."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()       # layout of the residual stream between blocks
    root = {
        # (b, s) ids -> (b, s, h): each rank looks up its vocabulary rows, the partial sums reduced
        # (all-reduce) or reduce-scattered along the sequence (sp).
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                              use_local_output=not sp),
        # (b, s, h) -> (b, s, V/tp) logits, never gathered: loss_parallel computes the loss.
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    layer = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual, use_local_output=not sp),
    }
    if not sp:
        root["model.norm"] = _no_parallel()
        layer["input_layernorm"] = _no_parallel()
        layer["post_attention_layernorm"] = _no_parallel()
    else:
        root["model.norm"] = SequenceParallel()
        layer.update({
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            # HF calls self_attn(hidden_states=...) by keyword and mlp(x) positionally.
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
        })
    return root, layer


def tensor_parallelize_llama(model, tp_mesh, sequence_parallel: bool):
    """Apply the plan in place (per decoder layer, as torchtitan); heads must divide by the tp size."""
    from torch.distributed.tensor.parallel import parallelize_module
    tp = tp_mesh.size()
    cfg = model.config
    for name, value in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads",
                        cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size),
                        ("vocab_size", cfg.vocab_size)):
        if value % tp:
            raise ValueError(f"torch TP: {name}={value} is not divisible by tp={tp}")
    root, layer = llama_tp_plan(sequence_parallel)
    for block in model.model.layers:
        parallelize_module(block, tp_mesh, layer)
    parallelize_module(model, tp_mesh, root)
    return model


def loss_parallel_step(ctx, model, opt, x: torch.Tensor, autocast: bool):
    """The causal-LM loss (HF's: token t predicts t + 1, the last position unlabelled) on
    vocabulary-sharded logits, under torch's loss_parallel (forward and backward inside it)."""
    from torch.distributed.tensor.parallel import loss_parallel
    labels = F.pad(x, (0, 1), value=-100)[..., 1:]

    def step():
        with ctx.autocast(autocast):
            logits = model(input_ids=x).logits           # DTensor (b, s, V) sharded on V
        with loss_parallel():
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
    return step
