"""What both sides of a train_bench pair share: the HF model config from the flags, the randomly
initialised model (the same weights on every rank and for both sides: one seed, built on the
device), the fixed token batch of each data-parallel replica, the parallel layout of a strategy,
the optimizer and the precision. Nothing here communicates.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "tp", "tp-sp", "pp-gpipe", "pp-1f1b", "pp-interleaved",
              "pp-gpipe-graphs", "pp-1f1b-graphs", "pp-interleaved-graphs", "tp2xdp2", "tp-sp-async"]
# Left out of --strategy all: the -graphs pairs need CUDA, tp-sp-async needs --compile.
EXPLICIT_ONLY = ("-graphs", "-async")
MODELS = ["hf-llama", "hf-gpt2"]
# Flag defaults per model: a 1.1B Llama (Llama-3.2-1B's shape with a 32000 vocabulary) and GPT-2 medium.
DEFAULTS = {
    "hf-llama": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=32000, seq=2048),
    "hf-gpt2": dict(hidden=1024, layers=24, heads=16, kv_heads=None, intermediate=None, vocab=50257, seq=1024),
}
TP_STRATEGIES = ("tp", "tp-sp", "tp-sp-async", "tp2xdp2")


@dataclass(frozen=True)
class Layout:
    """How the world is split: rank = (pp_rank · dp + dp_rank) · tp + tp_rank (tp fastest), the order
    of pynccl.ParallelMesh and of torch's init_device_mesh over ("dp", "tp")."""
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def coords(self, rank: int):
        """(dp_rank, tp_rank, pp_rank)."""
        return (rank // self.tp) % self.dp, rank % self.tp, rank // (self.tp * self.dp)

    def __str__(self):
        return " × ".join(f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp)) if v > 1) or "1"


def layout_of(strategy: str, world_size: int) -> Layout:
    if strategy in ("ddp", "zero1", "zero2", "zero3"):
        return Layout(dp=world_size)
    if strategy in ("tp", "tp-sp", "tp-sp-async"):
        return Layout(tp=world_size)
    if strategy.startswith("pp-"):
        return Layout(pp=world_size)
    if strategy == "tp2xdp2":
        if world_size % 2:
            raise ValueError(f"tp2xdp2 needs an even world size (tp 2 × dp world/2), got {world_size}")
        return Layout(dp=world_size // 2, tp=2)
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")


def pp_schedule(strategy: str):
    """'pp-1f1b-graphs' -> ('1f1b', True): the schedule, and whether pynccl's stages replay CUDA graphs
    (PipelineStage(cuda_graph=True); torch.distributed.pipelining's side runs the same schedule eagerly)."""
    kind = strategy[len("pp-"):]
    graphs = kind.endswith("-graphs")
    return (kind[:-len("-graphs")] if graphs else kind), graphs


def parse_strategies(text: str):
    if text == "all":
        names = [s for s in STRATEGIES if not s.endswith(EXPLICIT_ONLY)]
    else:
        names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise ValueError(f"--strategy: unknown {bad or text!r}; expected a comma list of "
                         f"{', '.join(STRATEGIES)} or 'all'")
    return names


def hf_config(args, untie: bool = False):
    """The transformers config of --model with the size flags (dropout off: both sides must see
    the same computation; KV cache off: training)."""
    import transformers
    if args.model == "hf-llama":
        return transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
            max_position_embeddings=max(args.seq, 2048), use_cache=False, attn_implementation="sdpa",
            tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2Config(
        vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_inner=args.intermediate,
        n_positions=max(args.seq, 1024), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        attn_implementation="sdpa", tie_word_embeddings=not untie, bos_token_id=0, eos_token_id=0)


def model_class(config):
    import transformers
    llama = isinstance(config, transformers.LlamaConfig)
    return transformers.LlamaForCausalLM if llama else transformers.GPT2LMHeadModel


def preload() -> None:
    """Import what the runs use before processes fork: transformers loads each model family lazily,
    and on a busy two-core machine that costs each process tens of seconds."""
    import transformers
    import transformers.masking_utils  # noqa: F401
    for name in ("LlamaConfig", "LlamaForCausalLM", "GPT2Config", "GPT2LMHeadModel"):
        getattr(transformers, name)


def num_params(config) -> int:
    with torch.device("meta"):
        model = model_class(config)(config)
    return sum(p.numel() for p in model.parameters())


@dataclass
class Trainer:
    """One side of a pair, built: step() runs one training step and returns this rank's loss
    (a detached scalar) or None where this rank computes none (pipeline stages before the last)."""
    step: Callable[[], Optional[torch.Tensor]]
    keep: list = field(default_factory=list)     # what must stay alive while step() is used
    instrument: Optional[Callable] = None        # pipelines: instrument(timeline) times each action (--timeline)
    close: Optional[Callable] = None             # undoes process-wide settings the build made (async TP's)
    recipe: str = "eager"                        # how it was compiled (compile_recipes.py), for the table


@dataclass
class BenchContext:
    args: object
    device: torch.device
    world_size: int
    rank: int
    compute_dtype: torch.dtype          # bf16 (default on GPU) or fp32
    compiled: bool = False              # build the side's torch.compile recipe (compile_recipes.py)
    # The data-parallel group a runner wraps with: None, the default group (every rank); --floor's
    # 1-rank groups of rank 0 (floor.py), with world_size 1 and rank 0 here.
    pynccl_group: object = None
    torch_group: object = None

    @property
    def bf16(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def build_model(self, strategy: str):
        """Random init from one seed on the device: the same fp32 weights on every rank, for
        either side. GPT-2 is untied for pipelining (the two ends sit on different stages).
        --grad-ckpt: HF gradient checkpointing on."""
        config = hf_config(self.args, untie=strategy.startswith("pp-"))
        torch.manual_seed(self.args.seed)
        with torch.device(self.device):
            model = model_class(config)(config)
        if getattr(self.args, "grad_ckpt", False):    # --grad-ckpt: before any wrapping, on both sides
            model.gradient_checkpointing_enable()
        return model.train()

    def tokens(self, dp_rank: int) -> torch.Tensor:
        """(batch, seq) token ids of one data-parallel replica: fixed for the whole run (the loss
        falls, so the losses of the two sides compare), the same on every rank of the replica."""
        g = torch.Generator().manual_seed(1000 * self.args.seed + dp_rank)
        return torch.randint(0, self.args.vocab, (self.args.batch, self.args.seq), generator=g).to(self.device)

    def adamw_kwargs(self, impl: Optional[str] = None) -> dict:
        """AdamW's arguments as a training script writes them; impl: fused (default on GPU),
        foreach, for-loop."""
        impl = impl or self.args.optim_impl
        if impl == "auto":
            impl = "fused" if self.device.type == "cuda" else "foreach"
        kw = dict(fused=True) if impl == "fused" else dict(foreach=impl == "foreach")
        return dict(lr=self.args.lr, betas=(0.9, 0.95), weight_decay=0.1, **kw)

    def optimizer(self, params, impl: Optional[str] = None) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **self.adamw_kwargs(impl))

    def autocast(self, enabled: bool = True):
        """bf16 autocast for the strategies that keep fp32 parameters (DDP, TP, PP, as torchtitan
        does without FSDP); ZeRO / FSDP2 compute in bf16 parameters instead."""
        if not (enabled and self.bf16):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def hf_lm_step(ctx: BenchContext, model, opt, x: torch.Tensor, autocast: bool) -> Callable:
    """A training step as an HF script writes it: the model's own causal-LM loss (labels = inputs).
    Under --compile-mode reduce-overhead each step starts a new generation of CUDA-graph replays
    (torch.compiler.cudagraph_mark_step_begin), as torch asks of a training loop."""
    graphs = ctx.compiled and ctx.args.compile_mode == "reduce-overhead"

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with ctx.autocast(autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def pipeline_trainer(ctx: BenchContext, kind: str, make_stage: Callable, schedules: dict) -> Trainer:
    """Either side's pipeline: this rank's HF stages (pynccl.pipeline.hf; 2 per rank for interleaved),
    make_stage(module, stage_index, num_stages) wrapping each, schedules[kind] running them on
    --microbatches micro-batches. The two APIs take the same step() call: inputs on the first stage,
    target and losses on the last; the loss is the mean of the micro-batches'."""
    from pynccl.pipeline import causal_lm_loss, hf_stage_modules
    pp, pp_rank = ctx.world_size, ctx.rank
    v = 2 if kind == "interleaved" else 1
    num_stages = pp * v
    model = ctx.build_model(f"pp-{kind}")
    mods = hf_stage_modules(model, pp_rank, pp, stages_per_rank=v)
    del model                                   # only this rank's stages stay referenced
    stages = [make_stage(mod, k, num_stages) for mod, k in zip(mods, range(pp_rank, num_stages, pp))]
    sched = schedules[kind](stages if v > 1 else stages[0], ctx.args.microbatches, loss_fn=causal_lm_loss)
    opt = ctx.optimizer([p for mod in mods for p in mod.parameters()])
    x = ctx.tokens(0)
    has_first, has_last = pp_rank == 0, pp_rank == (num_stages - 1) % pp

    def step():
        losses = []
        with ctx.autocast():
            sched.step(*([x] if has_first else []), target=x if has_last else None, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if losses else None

    def instrument(timeline):
        from .timeline import install
        install(sched, stages, timeline)
    return Trainer(step, [mods, stages, sched, opt], instrument)
