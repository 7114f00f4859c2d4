"""Model FLOPs utilisation as torchtitan reports it (torchtitan/models/utils.py,
get_dense_model_nparams_and_flops; torchtitan/components/metrics.py), so train_bench's figures
read next to torchtitan's and Megatron's published ones:

    flops per token = 6 · N + 12 · L · H · D · T
    MFU             = flops per token · tokens/s per GPU / the GPU's dense bf16 peak

N: the parameters that take part in a matrix product, counted once (tied weights once): every
parameter but the embedding tables (nn.Embedding; GPT-2's position table too), plus a token
table tied to the output head (the head's product uses it). L layers, H query heads, D head dim,
T the sequence length: 12·L·H·D·T is attention's two products (QKᵀ and PV, forward 1 + backward 2,
2 flops each multiply-add), with the causal mask ignored and flash attention's recomputation not
counted (torchtitan's convention, which passes head_dims = 2·D for "qk + v"). tokens/s per GPU:
the whole job's tokens / step time / world size (torchtitan divides the tokens of a data-parallel
replica by the GPUs of that replica; the same number).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

# Dense bf16 tensor-core peaks (FLOP/s), by a substring of torch.cuda.get_device_name(); the first
# match wins, so the more specific names come first (torchtitan/tools/utils.py, get_peak_flops).
PEAK_BF16_FLOPS = [
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),                 # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("H20", 148e12),
    ("GB200", 2.5e15),
    ("GB300", 2.5e15),
    ("B200", 2.25e15),
    ("B300", 2.25e15),
    ("A100", 312e12),
]


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a GPU by its name, or None for one not in the table (reported n/a)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def matmul_params(model: nn.Module) -> int:
    """N of the formula: distinct parameters, less the embedding tables, plus a table that the
    output head shares (its product counts)."""
    params = {id(p): p.numel() for p in model.parameters()}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # HF models name their head through get_output_embeddings(); nanoGPT's GPT calls it lm_head.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    tied = {id(head.weight)} & tables if head is not None else set()
    return sum(n for i, n in params.items() if i not in tables or i in tied)


def flops_per_token(model: nn.Module, num_layers: int, num_heads: int, head_dim: int, seq: int) -> int:
    """6·N + 12·L·H·D·T for one training token (forward and backward)."""
    return 6 * matmul_params(model) + 12 * num_layers * num_heads * head_dim * seq


def hf_flops_per_token(config, seq: int) -> int:
    """The formula for a transformers LlamaConfig / GPT2Config (the model is built on the meta
    device: no memory, no init)."""
    import transformers
    llama = isinstance(config, transformers.LlamaConfig)
    cls = transformers.LlamaForCausalLM if llama else transformers.GPT2LMHeadModel
    with torch.device("meta"):
        model = cls(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return flops_per_token(model, config.num_hidden_layers, heads, head_dim, seq)


def mfu(flops_token: int, tokens_per_s_per_gpu: float, peak: Optional[float]) -> Optional[float]:
    """The fraction (0..1) of the peak, or None where the peak is unknown."""
    if peak is None or not peak > 0:
        return None
    return flops_token * tokens_per_s_per_gpu / peak
