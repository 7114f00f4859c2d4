"""A stock torch DDP training script, moved to pynccl by swapping two lines (marked SWAP).

    torchrun --nproc_per_node 2 examples/train_ddp.py            # CPU: gloo is chosen
    torchrun --nproc_per_node 8 examples/train_ddp.py            # GPUs: nccl, one per process

Synthetic classification (a fixed random "teacher" labels Gaussian inputs), DistributedSampler,
a few epochs; rank 0 prints the mean loss of each epoch over all ranks.
"""
import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pynccl
from pynccl import DistributedDataParallel as DDP   # SWAP: was `from torch.nn.parallel import Distrib...`


def make_dataset(num_samples: int, num_features: int = 32, num_classes: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(0)        # same data on every rank; the sampler splits it
    x = torch.randn(num_samples, num_features, generator=g)
    teacher = torch.randn(num_features, num_classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    pynccl.init_process_group(backend=backend)       # SWAP: was torch.distributed.init_process_group(backend)
    rank, world_size = pynccl.get_rank(), pynccl.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    dataset = make_dataset(args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        totals = torch.zeros(2, dtype=torch.float64, device=device)   # (sum of losses, samples)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            totals += torch.stack([loss.detach().double() * len(x), torch.tensor(len(x), device=device)])
        pynccl.all_reduce(totals)
        if rank == 0:
            print(f"epoch {epoch} loss {(totals[0] / totals[1]).item():.4f} (world size {world_size}, {backend})",
                  flush=True)

    pynccl.destroy_process_group()


if __name__ == "__main__":
    main()
