"""Train a small character-level GPT with data × tensor × pipeline parallelism (and ZeRO).

    torchrun --nproc_per_node 2 examples/train_gpt.py --tp 2 --steps 50          # CPU: gloo
    torchrun --nproc_per_node 4 examples/train_gpt.py --tp 2 --pp 2 --sequence-parallel
    torchrun --nproc_per_node 4 examples/train_gpt.py --zero 2                   # dp = 4 / (tp·pp)
    torchrun --nproc_per_node 8 examples/train_gpt.py --tp 2 --pp 2 --zero 3     # GPUs: nccl
    python examples/train_gpt.py --steps 20                                      # one process

One ParallelMesh(dp, tp, pp) carries the layout: the model's TP layers are built on
mesh.tp_group, the pipeline sends over mesh.pp_group, DDP / ZeRO reduce over mesh.dp_group, and
gradient clipping and checkpoints know which shards are whose from it. Every layout trains the
same model on the same batches: same losses as one process (tests/test_gpt_3d.py checks it),
and checkpoints that load into any other layout (gpt/checkpoint.py).
Files: gpt/model.py (the model, one pipeline stage of it), gpt/data.py (text, batches),
gpt/parallel.py (DDP/ZeRO, micro-batches and pipeline, clipping), gpt/checkpoint.py.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402 - the gpt/ package next to us

import pynccl  # noqa: E402
from pynccl.mesh import ParallelMesh  # noqa: E402
from pynccl.tensor_parallel import model_parallel_seed  # noqa: E402

from gpt import checkpoint  # noqa: E402
from gpt.data import dp_slice, global_batch, load_corpus  # noqa: E402
from gpt.model import GPTConfig, GPTStage, check_fits, lm_loss, tp_shard_spec  # noqa: E402
from gpt.parallel import StepRunner, check_combination, clip_grad_norm_, wrap_data_parallel  # noqa: E402
from launch import run_in_process_group  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layout = p.add_argument_group("layout (dp × tp × pp must equal the number of processes)")
    layout.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp·pp))")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    layout.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    layout.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                        help="0: DDP over dp; 1/2/3: ZeRO stage over dp")
    layout.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/dropout activations over tp")
    layout.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    layout.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches per step (pipeline depth; gradient accumulation at pp=1); default 2·pp")
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--hidden", type=int, default=64)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--seq-len", type=int, default=64)
    model.add_argument("--dropout", type=float, default=0.0)
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step, all of dp)")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine to lr/10)")
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--data", default=None, help="a text file (default: generated sentences)")
    io = p.add_argument_group("checkpoints and output")
    io.add_argument("--save", default=None, metavar="DIR", help="save a consolidated checkpoint at the end")
    io.add_argument("--save-every", type=int, default=0, help="also every N steps (DIR/step_000N.pt)")
    io.add_argument("--resume", default=None, metavar="DIR", help="resume from DIR's latest checkpoint (or a file)")
    io.add_argument("--log-every", type=int, default=10, help="print a line every N steps (0: never)")
    io.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    if args.micro_batches is None:
        args.micro_batches = 2 * args.pp
    return args


def lr_at(step: int, args) -> float:
    """Linear warmup over the first 10% of steps, then cosine decay to lr / 10 (a pure function
    of the step, so a resumed run follows the same schedule)."""
    warmup = max(1, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args: argparse.Namespace) -> dict:
    """Train on the already initialised pynccl process group; returns {"losses", "grad_norms", ...}
    (the global mean loss of every step, the same on every rank)."""
    mesh = ParallelMesh(dp=args.dp, tp=args.tp, pp=args.pp)
    check_combination(mesh, args.zero)
    data, tokenizer = load_corpus(args.data)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, seq_len=args.seq_len, num_layers=args.layers,
                       hidden_size=args.hidden, num_heads=args.heads, dropout=args.dropout)
    check_fits(config, mesh, args.batch_size, args.micro_batches, args.sequence_parallel)
    device = pynccl.get_default_group().backend.device

    stage = GPTStage(config, mesh, args.sequence_parallel, args.activation_checkpointing, args.seed)
    spec, names = tp_shard_spec(stage), [n for n, _ in stage.named_parameters()]
    stage.to(device)                                # built on the CPU: the same weights on any device
    # Dropout: same masks on TP-replicated activations, distinct ones on shards and per stage.
    model_parallel_seed(args.seed + 100 * mesh.pp_rank, mesh.tp_rank)
    model = wrap_data_parallel(stage, mesh, args.zero)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    loss_fn = lambda logits, y: lm_loss(logits, y, mesh.tp_group, config.vocab_size)  # noqa: E731
    runner = StepRunner(model, mesh, args.micro_batches, loss_fn)

    start = 0
    if args.resume:
        start = checkpoint.load(args.resume, model, optimizer, mesh, spec, names, config)["step"]
    layout = dict(dp=mesh.dp_size, tp=mesh.tp_size, pp=mesh.pp_size, zero=args.zero,
                  sequence_parallel=args.sequence_parallel)

    def save(step):
        checkpoint.save(os.path.join(args.save, f"step_{step:06d}.pt"), model, optimizer, mesh, spec, names,
                        config, step, layout)

    if mesh.rank == 0 and args.log_every:
        print(f"dp{mesh.dp_size}·tp{mesh.tp_size}·pp{mesh.pp_size} on {mesh.world_size} {device.type} process(es), "
              f"{f'ZeRO-{args.zero}' if args.zero else 'DDP' if mesh.dp_size > 1 else 'no data parallelism'}, sequence parallel {args.sequence_parallel}, "
              f"activation checkpointing {args.activation_checkpointing}, {args.micro_batches} micro-batches; "
              f"vocabulary {config.vocab_size} (padded {config.padded_vocab_size}); from step {start}", flush=True)
    bar = None
    if mesh.rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm
        except ImportError:                         # e.g. an offline machine without it: log lines only
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=args.steps, initial=start, dynamic_ncols=True,
                       desc=f"dp{mesh.dp_size}·tp{mesh.tp_size}·pp{mesh.pp_size}")
    losses, grad_norms = [], []
    tokens_per_step = args.batch_size * args.seq_len
    tokens_per_s = None                             # smoothed (the first step also builds buffers)
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        optimizer.zero_grad(set_to_none=True)
        x, y = global_batch(data, step, args.seed, args.batch_size, args.seq_len)
        x = dp_slice(x, mesh.dp_rank, mesh.dp_size).to(device)
        y = dp_slice(y, mesh.dp_rank, mesh.dp_size).to(device)
        local_loss = runner.step(x, y)
        grad_norms.append(clip_grad_norm_(model, mesh, spec, args.clip))
        optimizer.step()
        # The loss lives on the last stage (each of its TP ranks holds it): one scalar all-reduce.
        loss = torch.zeros(1, dtype=torch.float64, device=device)
        if local_loss is not None and mesh.tp_rank == 0:
            loss += local_loss.double() / mesh.dp_size
        pynccl.all_reduce(loss)
        losses.append(loss.item())
        rate = tokens_per_step / (time.perf_counter() - t0)
        tokens_per_s = rate if tokens_per_s is None or step == start + 1 else 0.9 * tokens_per_s + 0.1 * rate
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            bar.update(1)
        if mesh.rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            line = (f"step {step + 1} loss {losses[-1]:.4f} grad_norm {grad_norms[-1]:.3f} "
                    f"lr {lr_at(step, args):.2e} {tokens_per_s:,.0f} tok/s")
            bar.write(line) if bar is not None else print(line, flush=True)
        if args.save and args.save_every and (step + 1) % args.save_every == 0:
            save(step + 1)
    if bar is not None:
        bar.close()
    if args.save and (not args.save_every or args.steps % args.save_every):
        save(args.steps)
    if mesh.rank == 0:
        print(f"final loss {losses[-1]:.4f} after {args.steps} steps" if losses else
              f"nothing to train: resumed at step {start} of --steps {args.steps}", flush=True)
    return {"losses": losses, "grad_norms": grad_norms, "layout": layout, "start": start}


def main(argv=None) -> None:
    run_in_process_group(train, parse_args(argv))


if __name__ == "__main__":
    main()
