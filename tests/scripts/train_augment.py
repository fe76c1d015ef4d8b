"""A plain trainer for the transparency tests: shuffled DataLoader, random per-sample augmentation.

Runs the same with `python`, `torchrun` and cfrun. Its dataset's ``__getitem__`` draws from the
torch, numpy and python RNGs (in the workers with --workers > 0), the model has dropout (the main
process's torch RNG) and the loss weight draws from numpy and python in the main loop. Seeded
globally; --generator passes ``generator=torch.Generator().manual_seed(7)`` to the DataLoader,
--persistent ``persistent_workers=True``, --unordered ``in_order=False``.
With ``WORLD_SIZE`` > 1 (torchrun) it trains DDP on gloo with a DistributedSampler. Prints one metric
line per epoch (rank 0) and saves rank 0's final weights to --out.
"""

import argparse
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Augmented(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :4].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        noise = 0.3 * torch.randn(16)  # torch
        shift = float(np.random.uniform(-0.2, 0.2))  # numpy
        scale = random.uniform(0.8, 1.2)  # python
        return self.x[i] * scale + noise + shift, self.y[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--generator", action="store_true")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--unordered", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    ds = Augmented(600 * (2 if distributed else 1))
    gen = torch.Generator().manual_seed(7) if args.generator else None
    sampler = DistributedSampler(ds, shuffle=True) if distributed else None
    loader = DataLoader(ds, batch_size=32, shuffle=sampler is None, sampler=sampler,
                        num_workers=args.workers, generator=gen,
                        persistent_workers=args.persistent, in_order=not args.unordered)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        total, first = 0.0, None
        for i, (x, y) in enumerate(loader):
            weight = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
            loss = weight * F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            first = loss.item() if first is None else first
        if rank == 0:
            print(f"epoch {epoch} first {first:.10f} mean {total / (i + 1):.10f}", flush=True)
    if rank == 0:
        torch.save(model.state_dict(), args.out)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
