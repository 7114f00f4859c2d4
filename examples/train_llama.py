"""Train a Hugging Face Llama (random init, tiny by default) with data × tensor parallelism:
the unmodified LlamaForCausalLM, split by pynccl's plan, under DDP or ZeRO over the data axis.

    python examples/train_llama.py --steps 20                                         # one process
    torchrun --nproc_per_node 4 examples/train_llama.py --tp 2                        # dp 2 × tp 2, DDP
    torchrun --nproc_per_node 4 examples/train_llama.py --tp 2 --zero 3 --sequence-parallel
    torchrun --nproc_per_node 4 examples/train_llama.py --tp 4 --save /tmp/llama      # save_pretrained

A ParallelMesh(dp, tp) gives the groups: parallelize_module(model, mesh.tp_group,
plans.llama(...)) shards the model in place, and DDP / FullyShardedDataParallel reduce its
(sharded) gradients over mesh.dp_group. Every layout trains the same model on the same batches,
so the losses equal one process's (tests/test_train_llama.py checks it), and --save writes
a checkpoint the plain model loads (LlamaForCausalLM.from_pretrained).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402 - launch.py next to us

import pynccl  # noqa: E402
import pynccl.tensor_parallel as tp  # noqa: E402
from pynccl.mesh import ParallelMesh  # noqa: E402

from launch import run_in_process_group  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="0: DDP over dp; 1/2/3: ZeRO stage")
    p.add_argument("--sequence-parallel", action="store_true", help="norms and residuals on sequence shards")
    p.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                   help="gather the logits and run the model's own loss")
    model = p.add_argument_group("model (LlamaConfig)")
    model.add_argument("--vocab", type=int, default=128)
    model.add_argument("--hidden", type=int, default=64)
    model.add_argument("--ffn", type=int, default=128, help="intermediate_size")
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2, help="num_key_value_heads (grouped-query attention)")
    train = p.add_argument_group("training")
    train.add_argument("--seq-len", type=int, default=16)
    train.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    train.add_argument("--steps", type=int, default=10)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--save", default=None, help="directory for save_pretrained of the trained model")
    train.add_argument("--log-every", type=int, default=1, help="print every N steps (0: only the last)")
    return p.parse_args(argv)


def llama_config(args: argparse.Namespace):
    from transformers import LlamaConfig
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq_len, 64),
                         attention_dropout=0.0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    return config


def build_model(args: argparse.Namespace):
    """The same random init on every rank (and in a single-process run): seeded, on the CPU, fp32."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(llama_config(args))


def global_batch(args: argparse.Namespace, step: int) -> torch.Tensor:
    """(batch, seq) token ids of this step, the same on every rank: random starts, then each
    token 7 past the previous one (mod vocab), a bigram rule the model learns in a few steps."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    starts = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    return (starts + 7 * torch.arange(args.seq_len)) % args.vocab


def make_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def wrap_data_parallel(model, mesh: ParallelMesh, args: argparse.Namespace):
    if args.zero:
        return pynccl.FullyShardedDataParallel(model, stage=args.zero, process_group=mesh.dp_group)
    if mesh.dp_size > 1:
        return pynccl.DistributedDataParallel(model, process_group=mesh.dp_group)
    return model


def train(args: argparse.Namespace) -> dict:
    """Returns {"losses": the global mean loss of each step (the same on every rank)}."""
    world = pynccl.get_world_size()
    mesh = ParallelMesh(dp=args.dp, tp=args.tp)
    sequence = {"seq_len": args.seq_len} if args.sequence_parallel else {}
    mesh.check_divides(batch_size=args.batch_size, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, **sequence)
    device = pynccl.get_default_group().backend.device
    model = build_model(args)
    model = tp.parallelize_module(model, mesh.tp_group, tp.plans.llama(args.sequence_parallel, args.loss_parallel))
    model.to(device)
    wrapped = wrap_data_parallel(model, mesh, args)
    optimizer = make_optimizer(wrapped.parameters(), args)
    rows = args.batch_size // mesh.dp_size
    strategy = f"ZeRO-{args.zero}" if args.zero else ("DDP" if mesh.dp_size > 1 else "no data parallelism")
    if mesh.rank == 0:
        print(f"dp{mesh.dp_size}·tp{mesh.tp_size} on {world} {device.type} process(es), "
              f"{strategy}, sequence_parallel={args.sequence_parallel}, "
              f"loss_parallel={args.loss_parallel}", flush=True)
    losses = []
    for step in range(args.steps):
        x = global_batch(args, step)[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows].to(device)
        loss = wrapped(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Every sequence has seq_len - 1 targets, so the global mean is the mean over dp ranks.
        total = loss.detach().double().reshape(1)
        pynccl.all_reduce(total, group=mesh.dp_group)
        losses.append(total.item() / mesh.dp_size)
        last = step == args.steps - 1
        if mesh.rank == 0 and (last or (args.log_every and step % args.log_every == 0)):
            print(f"step {step:4d}  loss {losses[-1]:.6f}", flush=True)
    if args.save:
        save_pretrained(wrapped, mesh, args)
    return {"losses": losses}


def save_pretrained(wrapped, mesh: ParallelMesh, args: argparse.Namespace) -> None:
    """Gather the TP shards (and the ZeRO shards) into one Hugging Face checkpoint, written by
    rank 0. Collective: every rank calls it."""
    from transformers import LlamaForCausalLM
    full = tp.unsharded_state_dict(wrapped, mesh.tp_group)
    if mesh.rank == 0:
        cpu = {name: tensor.cpu() for name, tensor in full.items()}
        LlamaForCausalLM(llama_config(args)).save_pretrained(args.save, state_dict=cpu)
        print(f"saved {args.save}", flush=True)
    pynccl.barrier()


def main(argv=None) -> None:
    run_in_process_group(train, parse_args(argv))


if __name__ == "__main__":
    main()
