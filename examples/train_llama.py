"""Train a Hugging Face Llama (random init, tiny by default) with data × tensor × pipeline parallelism:
the unmodified LlamaForCausalLM, split by pynccl's plan, cut into pipeline stages, under DDP or
ZeRO over the data axis.

    python examples/train_llama.py --steps 20                                         # one process
    torchrun --nproc_per_node 4 examples/train_llama.py --tp 2                        # dp 2 × tp 2, DDP
    torchrun --nproc_per_node 4 examples/train_llama.py --tp 2 --zero 3 --sequence-parallel
    torchrun --nproc_per_node 4 examples/train_llama.py --tp 4 --save /tmp/llama      # save_pretrained
    torchrun --nproc_per_node 4 examples/train_llama.py --tp 2 --pp 2 --micro-batches 4
    torchrun --nproc_per_node 4 examples/train_llama.py --pp 2 --zero 3 --schedule gpipe

A ParallelMesh(dp, tp, pp) gives the groups: parallelize_module(model, mesh.tp_group,
plans.llama(...)) shards the whole model in place, then (pp > 1) hf_stage_modules cuts this
rank's stage from it (embeddings on the first, norm + head + loss on the last), run by
Schedule1F1B / ScheduleGPipe over mesh.pp_group with causal_lm_loss (or its vocabulary-parallel
form). DDP / FullyShardedDataParallel reduce the (stage's, sharded) gradients over
mesh.dp_group. Every layout trains the same model on the same batches, so the losses equal one
process's (tests/test_train_llama.py checks it), and --save writes a checkpoint the plain model
loads (LlamaForCausalLM.from_pretrained); under pp the stages are gathered to rank 0.
Refused with pp > 1: ZeRO-1/2 (they decide in forward whether a backward reduces; a pipeline
runs several forwards first: see examples/gpt/parallel.py) and --sequence-parallel (the hidden
states between stages are sequence shards, and each stage derives positions and the causal mask
from the length it receives).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # noqa: E402 - launch.py next to us

import pynccl  # noqa: E402
import pynccl.tensor_parallel as tp  # noqa: E402
from pynccl.mesh import ParallelMesh  # noqa: E402
from pynccl.pipeline import (PipelineStage, Schedule1F1B, ScheduleGPipe, causal_lm_loss,  # noqa: E402
                             hf_stage_modules)
from pynccl.tensor_parallel.loss_parallel import vocab_parallel_causal_lm_loss  # noqa: E402

from launch import run_in_process_group  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step under pp > 1 (default: 2 × pp)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"), help="pipeline schedule")
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


def check_combination(mesh: ParallelMesh, args: argparse.Namespace) -> None:
    if mesh.pp_size == 1:
        return
    if args.zero in (1, 2):
        raise ValueError(f"--zero {args.zero} with --pp {mesh.pp_size} is not supported: ZeRO-{args.zero} decides in "
                         f"forward whether a backward reduces, and a pipeline runs several forwards first; use "
                         f"--zero 3 (reduces every micro-batch) or --zero 0 (DDP) with pipeline parallelism")
    if args.sequence_parallel:
        raise ValueError(f"--sequence-parallel with --pp {mesh.pp_size} is not supported: the hidden states between "
                         f"stages would be sequence shards, and each stage derives the positions and the causal "
                         f"mask from the sequence length it receives; drop --sequence-parallel or use --pp 1")
    if args.micro_batches < 1 or (args.batch_size // mesh.dp_size) % args.micro_batches:
        raise ValueError(f"--micro-batches must be a positive divisor of the per-dp-rank batch "
                         f"({args.batch_size} / dp {mesh.dp_size} = {args.batch_size // mesh.dp_size}), "
                         f"got {args.micro_batches}")


class _ReduceEveryMicroBatch(torch.nn.Module):
    """A ZeRO-3 stage seen by the pipeline without no_sync(): every micro-batch's backward
    reduce-scatters into the shard gradients, which add up (as in examples/gpt/parallel.py)."""

    def __init__(self, fsdp: torch.nn.Module):
        super().__init__()
        self.fsdp = fsdp

    def forward(self, *args):
        return self.fsdp(*args)


def pipeline_schedule(wrapped, mesh: ParallelMesh, args: argparse.Namespace, device):
    """This rank's stage (wrapped for dp) in the schedule of --schedule over mesh.pp_group."""
    piped = _ReduceEveryMicroBatch(wrapped) if args.zero else wrapped
    stage = PipelineStage(piped, mesh.pp_rank, mesh.pp_size, device=device, group=mesh.pp_group)
    if args.loss_parallel:   # the head's logits are vocabulary slices: never gathered
        loss_fn = functools.partial(vocab_parallel_causal_lm_loss, vocab_size=args.vocab, group=mesh.tp_group)
    else:
        loss_fn = causal_lm_loss
    cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    return cls(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)


def pipeline_step(schedule, mesh: ParallelMesh, x: torch.Tensor) -> torch.Tensor:
    """One step's forwards and backwards; returns this dp rank's mean loss on every pp rank
    (the last stage has it; a sum over the pp group, where the others add 0, spreads it)."""
    losses = []
    if mesh.is_first_stage:
        schedule.step(x)
    elif mesh.is_last_stage:
        schedule.step(target=x, losses=losses)
    else:
        schedule.step()
    # Every micro-batch holds as many targets, so the mean of their means is the batch's mean.
    loss = torch.stack(losses).mean().double().reshape(1) if losses else torch.zeros(1, dtype=torch.float64,
                                                                                        device=x.device)
    pynccl.all_reduce(loss, group=mesh.pp_group)
    return loss


def wrap_data_parallel(model, mesh: ParallelMesh, args: argparse.Namespace):
    if args.zero:
        return pynccl.FullyShardedDataParallel(model, stage=args.zero, process_group=mesh.dp_group)
    if mesh.dp_size > 1:
        return pynccl.DistributedDataParallel(model, process_group=mesh.dp_group)
    return model


def train(args: argparse.Namespace) -> dict:
    """Returns {"losses": the global mean loss of each step (the same on every rank)}."""
    world = pynccl.get_world_size()
    mesh = ParallelMesh(dp=args.dp, tp=args.tp, pp=args.pp)
    if args.micro_batches is None:
        args.micro_batches = 2 * mesh.pp_size
    check_combination(mesh, args)
    sequence = {"seq_len": args.seq_len} if args.sequence_parallel else {}
    mesh.check_divides(batch_size=args.batch_size, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, **sequence)
    if args.layers < mesh.pp_size:
        raise ValueError(f"--layers ({args.layers}) must be at least --pp ({mesh.pp_size}): one decoder layer a stage")
    device = pynccl.get_default_group().backend.device
    model = build_model(args)
    model = tp.parallelize_module(model, mesh.tp_group, tp.plans.llama(args.sequence_parallel, args.loss_parallel))
    tp_model, schedule = model, None
    if mesh.pp_size > 1:
        model = hf_stage_modules(model, mesh.pp_rank, mesh.pp_size)[0]   # the HF model's own submodules
    model.to(device)
    wrapped = wrap_data_parallel(model, mesh, args)
    if mesh.pp_size > 1:
        schedule = pipeline_schedule(wrapped, mesh, args, device)
    optimizer = make_optimizer(wrapped.parameters(), args)
    rows = args.batch_size // mesh.dp_size
    strategy = f"ZeRO-{args.zero}" if args.zero else ("DDP" if mesh.dp_size > 1 else "no data parallelism")
    if mesh.rank == 0:
        pipeline = f"·pp{mesh.pp_size} ({args.schedule}, {args.micro_batches} micro-batches)" \
            if mesh.pp_size > 1 else ""
        print(f"dp{mesh.dp_size}·tp{mesh.tp_size}{pipeline} on {world} {device.type} process(es), "
              f"{strategy}, sequence_parallel={args.sequence_parallel}, "
              f"loss_parallel={args.loss_parallel}", flush=True)
    losses = []
    for step in range(args.steps):
        x = global_batch(args, step)[mesh.dp_rank * rows:(mesh.dp_rank + 1) * rows].to(device)
        if schedule is not None:
            total = pipeline_step(schedule, mesh, x)
        else:
            loss = wrapped(input_ids=x, labels=x).loss
            loss.backward()
            total = loss.detach().double().reshape(1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Every sequence has seq_len - 1 targets, so the global mean is the mean over dp ranks.
        pynccl.all_reduce(total, group=mesh.dp_group)
        losses.append(total.item() / mesh.dp_size)
        last = step == args.steps - 1
        if mesh.rank == 0 and (last or (args.log_every and step % args.log_every == 0)):
            print(f"step {step:4d}  loss {losses[-1]:.6f}", flush=True)
    if args.save:
        save_pretrained(wrapped, mesh, args, tp_model)
    return {"losses": losses}


def save_pretrained(wrapped, mesh: ParallelMesh, args: argparse.Namespace, tp_model) -> None:
    """Gather the TP shards (and the ZeRO shards, and the pipeline stages) into one Hugging Face
    checkpoint, written by rank 0. Collective: every rank calls it."""
    from transformers import LlamaForCausalLM
    if mesh.pp_size == 1:
        full = tp.unsharded_state_dict(wrapped, mesh.tp_group)
    else:
        full = {}
        for part in gather_stages(wrapped, mesh, tp_model):
            full.update(part)
    if mesh.rank == 0:
        cpu = {name: tensor.cpu() for name, tensor in full.items()}
        LlamaForCausalLM(llama_config(args)).save_pretrained(args.save, state_dict=cpu)
        print(f"saved {args.save}", flush=True)
    pynccl.barrier()


def stage_state_dict(wrapped) -> dict:
    """This rank's stage's TP-sharded entries under the HF model's names (stage names map back:
    layers.i -> model.layers.<first layer + i>, lm_head stays, the rest sits in model.)."""
    stage = wrapped.module if isinstance(wrapped, (pynccl.DistributedDataParallel,
                                                   pynccl.FullyShardedDataParallel)) else wrapped
    local = wrapped.full_state_dict() if isinstance(wrapped, pynccl.FullyShardedDataParallel) else stage.state_dict()
    first = stage.layer_range[0]
    named = {}
    for key, value in local.items():
        if key.startswith("layers."):
            index, rest = key[len("layers."):].split(".", 1)
            key = f"model.layers.{first + int(index)}.{rest}"
        elif not key.startswith("lm_head."):
            key = "model." + key
        named[key] = value
    return named


def gather_stages(wrapped, mesh: ParallelMesh, tp_model) -> list:
    """[each pp stage's full (TP-gathered) entries, CPU] on pp rank 0 of each pipeline, [] elsewhere.
    tp_model: the HF model parallelize_module returned (it holds the shard layouts), whose
    submodules the stage is made of."""
    full = tp.unsharded_state_dict(tp_model, mesh.tp_group, state_dict=stage_state_dict(wrapped), partial=True)
    cpu = {name: tensor.cpu() for name, tensor in full.items()}
    root = mesh.pp_group.ranks[0]
    parts = [None] * mesh.pp_size if mesh.rank == root else None
    pynccl.gather_object(cpu, parts, dst=root, group=mesh.pp_group)
    return parts or []


def main(argv=None) -> None:
    run_in_process_group(train, parse_args(argv))


if __name__ == "__main__":
    main()
