"""The models ddp_bench times, each with the per-GPU batch and the optimizer its client uses:
nanoGPT's GPT-2 124M as its train.py configures it (the default), the bench's earlier GPT-2
small, HF transformers' GPT-2 medium, and tiny versions of both for CPU runs of the code paths.
"""
import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, num_heads: int, bias: bool, gelu_approx: str):
        super().__init__()
        self.num_heads = num_heads
        self.gelu_approx = gelu_approx
        self.ln1, self.ln2 = nn.LayerNorm(d, bias=bias), nn.LayerNorm(d, bias=bias)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d, bias=bias), nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)                      # 3 x (b, t, d)
        q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # (b, h, t, d/h)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate=self.gelu_approx))


class GPT(nn.Module):
    """GPT-2 as nanoGPT's model.py builds it: learned positions, pre-LayerNorm blocks, tied head.
    forward(idx, targets) -> mean cross-entropy (logits in fp32, as nanoGPT computes the loss);
    forward(idx) -> logits. The defaults are the bench's earlier model (zero_bench.py's too)."""

    def __init__(self, vocab=50304, ctx=1024, d=768, layers=12, heads=12, bias=True, gelu_approx="tanh"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, bias, gelu_approx) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=bias)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)                                    # (b, t, d)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))                                     # (b, t, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1)


class HFCausalLM(nn.Module):
    """transformers' GPT2LMHeadModel as an HF training loop calls it: model(input_ids, labels).loss."""

    def __init__(self, **config):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        self.lm = GPT2LMHeadModel(GPT2Config(**config))

    def forward(self, idx, targets):
        return self.lm(input_ids=idx, labels=targets, use_cache=False).loss


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    description: str
    build: Callable[[], nn.Module]
    batch: int            # sequences per GPU
    seq: int
    vocab: int
    # CUDA-graph modes hold their own memory pools beside every other mode's model: where that
    # does not fit an 80 GB H100 they are skipped unless --graph-modes asks for them.
    graph_modes_fit: bool = True


MODELS = {
    "nanogpt-124m": ModelSpec("nanoGPT GPT-2 124M (12 layers, 12 heads, d 768, vocab 50304, no biases)",
                              lambda: GPT(bias=False, gelu_approx="none"), batch=12, seq=1024, vocab=50304),
    "bench-gpt2-small": ModelSpec("GPT-2 small with biases and tanh GELU (ddp_bench's model before issue 19)",
                                  lambda: GPT(), batch=8, seq=1024, vocab=50304),
    "hf-gpt2-medium": ModelSpec("HF transformers GPT2LMHeadModel, GPT-2 medium (24 layers, 16 heads, d 1024)",
                                lambda: HFCausalLM(n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
                                                   vocab_size=50257), batch=8, seq=1024, vocab=50257,
                                graph_modes_fit=False),
    "tiny": ModelSpec("nanoGPT-shaped, 2 layers, d 64 (CPU runs of the code paths)",
                      lambda: GPT(vocab=512, ctx=64, d=64, layers=2, heads=4, bias=False, gelu_approx="none"),
                      batch=2, seq=64, vocab=512),
    "hf-tiny": ModelSpec("HF GPT2LMHeadModel, 2 layers, d 64 (CPU runs of the code paths)",
                         lambda: HFCausalLM(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=512,
                                            bos_token_id=0, eos_token_id=0),
                         batch=2, seq=64, vocab=512),
}


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: AdamW, weight decay on matrices only, fused on CUDA
    (capturable there too, so a step can be captured in a CUDA graph)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=0.1),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    cuda = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=cuda, capturable=cuda)
