"""What one tensor-parallel rank computes, with no communication at all, against the whole model on
one GPU: the bound that hiding TP's collectives cannot beat.

A rank of pynccl's `plans.llama()` (no sequence parallelism) keeps 1/tp of the attention heads, of
the KV heads, of the MLP's intermediate width and of the vocabulary (embedding and LM head), and
the norms, residuals and rotary tables whole. This builds that rank's model as a plain Hugging Face
Llama (`rank_config`; tests/test_tp_rank_floor.py holds its parameter shapes equal to a TP rank's)
and times it against the whole model in the same process, with train_bench's recipe for TP and its
floor: fp32 parameters, bf16 autocast, fused AdamW, the model's own loss, each block compiled where
asked (`compiled`: block.compile(); `graphed`: mode="reduce-overhead", each block a CUDA graph).
The ratio is issue 27's TP scaling (step / one-GPU step) that a perfect overlap would reach.

--sequence-parallel: a rank of `plans.llama(sequence_parallel=True)` instead, emulated on the same
rank model by hooks (`sequence_parallel_hooks`): the decoder layers, their norms and residuals and
the final norm see this rank's 1/tp of the sequence; each attention and MLP block's input is made
whole (the all-gather, here a concatenation: its local copy, no wire) and its output cut to the
rank's shard (the reduce-scatter, here a slice); the LM head reads the whole sequence. The test
holds every hooked module's input and output shapes equal to a gloo SP rank's. With --sequence-dim 0
(`plans.llama(sequence_parallel=True, sequence_dim=0)`) the shard is 1/tp of the batch instead:
contiguous slabs, so the stand-ins copy as the collectives would (none for a slice of dim 0); the
batch must divide by tp.

    python benchmarks/tp_rank_floor.py --model hf-llama --hidden 2048 --layers 16 --heads 32 \\
        --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048 --batch 4 --tp 2 --modes eager,compiled,graphed
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from train_bench_lib.models import hf_config   # the whole model as train_bench builds it

L1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv-heads": 8, "intermediate": 8192, "vocab": 32000, "seq": 2048}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="hf-llama", choices=["hf-llama"])
    for name, default in L1B.items():   # train_bench's size flags, Llama 1.1B's values by default
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="a rank of plans.llama(sequence_parallel=True), emulated (module docstring)")
    p.add_argument("--sequence-dim", type=int, choices=[0, 1],
                   help="with --sequence-parallel, the dim it splits: 1 the sequence (the default), 0 the batch")
    p.add_argument("--modes", default="eager,compiled,graphed",
                   help="comma-separated: eager, compiled (each block compiled), graphed (reduce-overhead)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in ("eager", "compiled", "graphed")]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from eager, compiled, graphed")
    if args.sequence_dim is not None and not args.sequence_parallel:
        p.error("--sequence-dim is the dim sequence parallelism splits: it needs --sequence-parallel")
    args.sequence_dim = 1 if args.sequence_dim is None else args.sequence_dim
    if args.sequence_parallel and args.sequence_dim == 0 and args.batch % args.tp:
        p.error(f"--sequence-dim 0 splits the batch: --batch ({args.batch}) must divide by --tp ({args.tp})")
    return args, modes


def rank_config(config, tp: int):
    """The config of what one rank of plans.llama() keeps at tensor-parallel size tp: heads, KV heads,
    intermediate width and vocabulary divided by tp, the head dim and the hidden width as they are.
    ValueError naming the size that does not divide."""
    import transformers
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"rank_config: {name} ({size}) does not divide by tp ({tp})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kwargs = {**config.to_dict(), **{k: v // tp for k, v in sizes.items()}, "head_dim": head_dim}
    return transformers.LlamaConfig(**kwargs)


def _on_hidden(fn):
    """A forward pre-hook applying fn to the module's hidden states, positional or keyword."""
    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return hook


def _on_output(fn):
    """A forward hook applying fn to the module's output (the first element of a tuple)."""
    def hook(module, args, output):
        return (fn(output[0]),) + tuple(output[1:]) if isinstance(output, tuple) else fn(output)
    return hook


def sequence_parallel_hooks(model, tp: int, sequence_dim: int = 1) -> list:
    """Make a rank model (rank_config) compute as a rank of plans.llama(sequence_parallel=True,
    sequence_dim=sequence_dim), with local stand-ins for its collectives (module docstring); returns
    the hook handles."""
    def shard(t):      # the reduce-scatter's output shape: this rank's 1/tp of the sequence or batch
        return t.narrow(sequence_dim, 0, t.shape[sequence_dim] // tp)

    def whole(t):      # the all-gather's: tp shards side by side
        return torch.cat([t] * tp, dim=sequence_dim)
    handles = [model.model.layers[0].register_forward_pre_hook(_on_hidden(shard), with_kwargs=True),
               model.lm_head.register_forward_pre_hook(_on_hidden(whole), with_kwargs=True)]
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            handles.append(block.register_forward_pre_hook(_on_hidden(whole), with_kwargs=True))
            handles.append(block.register_forward_hook(_on_output(shard)))
    return handles


def step_ms(config, mode: str, args, sequence_parallel: bool = False) -> float:
    """The median wall time of one training step (forward, backward, AdamW), synchronized."""
    import transformers
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    if sequence_parallel:
        sequence_parallel_hooks(model, args.tp, args.sequence_dim)
    if mode != "eager":
        for block in model.model.layers:
            block.compile(**({} if mode == "compiled" else {"mode": "reduce-overhead"}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    x = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    x = x.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times[args.warmup:])


def main(argv=None):
    args, modes = parse_args(argv)
    whole = hf_config(args)
    rank = rank_config(whole, args.tp)
    sp = args.sequence_parallel
    split = f", sequence parallel along the {('batch', 'sequence')[args.sequence_dim]}" if sp else ""
    print(f"# tp_rank_floor: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq}; a tp "
          f"{args.tp} rank keeps {rank.num_attention_heads} heads, {rank.num_key_value_heads} KV heads, intermediate "
          f"{rank.intermediate_size}, vocabulary {rank.vocab_size}{split}; "
          f"{torch.__version__} on {args.device}", flush=True)
    what = "sequence-parallel rank's" if sp else "rank's"
    for mode in modes:
        one, own = step_ms(whole, mode, args), step_ms(rank, mode, args, sp)
        print(f"{mode}: one GPU {one:.2f} ms, a tp {args.tp} {what} compute {own:.2f} ms = {own / one:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
