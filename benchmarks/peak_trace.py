"""What is live at the peak of one training step of one side of a train_bench pair, from torch's
CUDA memory history (torch.cuda.memory._record_memory_history): rank 0 prints the bytes allocated
during the step and still live at its largest total, grouped by the first pynccl / transformers /
torch.optim / FSDP / train_bench frame that allocated them. A diagnostic for peak-memory gaps
(issue 26: ZeRO-3 against FSDP2 under HF gradient checkpointing). CUDA only.

    torchrun --nproc_per_node 2 benchmarks/peak_trace.py --model hf-llama --hidden 2048 --layers 16 \\
        --heads 32 --kv-heads 8 --intermediate 8192 --vocab 32000 --seq 2048 --batch 4 \\
        --strategy zero3 --grad-ckpt --impl pynccl      # or --impl torch (FSDP2)

Takes train_bench's flags (the first --strategy, one --impl side, eager); two warm-up steps, then
the traced one.
"""
from __future__ import annotations

import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

import pynccl  # noqa: E402
import train_bench  # noqa: E402

OURS = ("pynccl", "transformers", "torch/optim", "torch/distributed/fsdp", "train_bench")


def _where(entry: dict) -> str:
    frames = entry.get("frames") or []
    mine = [f for f in frames if any(k in f["filename"] for k in OURS)]
    f = (mine or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    name = f["filename"].split("site-packages/")[-1]
    return f"{name}:{f['line']} {f['name']}"


def live_at_peak(trace: list) -> tuple:
    """(largest total of the step's live allocations, {address: alloc entry} live then)."""
    live, total, best, best_live = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return best, best_live


def main(argv=None) -> None:
    args = train_bench.parse_args(argv)
    if args.device != "cuda" or args.impl == "both":
        sys.exit("peak_trace: CUDA only, and one side: --impl pynccl or --impl torch")
    ctx = train_bench.init_distributed(args)
    trainer = train_bench.RUNNERS[args.impl](args.strategies[0], ctx)
    train_bench.free_device_memory(ctx)
    for _ in range(2):
        trainer.step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500000)
    torch.cuda.reset_peak_memory_stats()
    trainer.step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if ctx.rank == 0:
        best, live = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()])
        print(f"# {args.impl}: max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; allocated "
              f"in the traced step and live at its largest total: {best / 2**30:.2f} GiB")
        groups = collections.Counter()
        for e in live.values():
            groups[_where(e)] += e["size"]
        for where, n in groups.most_common(25):
            print(f"{n / 2**30:8.3f} GiB  {where}")
    tdist.barrier()
    pynccl.destroy_process_group()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
