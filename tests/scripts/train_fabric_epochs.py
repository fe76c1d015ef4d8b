"""A Lightning Fabric loop (DDP, 2 CPU ranks, gloo) whose epoch loop validates and saves:
``fabric.setup_dataloaders`` wraps the training loader (``_FabricDataLoader`` counts its
``iter()`` calls and sets the DistributedSampler's epoch from the count).

``train_fabric_epochs.py --epochs N --out FINAL --count-log LOG``: each rank appends a line to LOG
per ``validate()`` and rank 0 one per ``save()`` (``torch.save`` to a temporary file, then
``os.replace``), with ``os.write``: the count of epoch-end runs, whatever cfrun suppresses.
"""

import argparse
import os

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def note(path, line):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def validate(fabric, model, loader, args):
    note(args.log, f"validate rank {fabric.global_rank}")
    model.eval()
    total = torch.zeros(())
    with torch.no_grad():
        for x, y in loader:
            total += F.cross_entropy(model(x), y, reduction="sum")
    model.train()
    return fabric.all_reduce(total, reduce_op="sum").item()


def save(fabric, epoch, model, optimizer, args):
    if fabric.global_rank == 0:
        tmp = args.out + ".epoch.tmp"
        torch.save({"epoch": epoch, "model": model.state_dict(),
                    "opt": optimizer.state_dict()}, tmp)
        os.replace(tmp, args.out + ".epoch")
        note(args.log, f"save {epoch}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--count-log", dest="log", required=True)
    args = p.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(7)
    x = torch.randn(640, 8)
    y = (x[:, :3].sum(1) > 0).long()
    train_loader = DataLoader(TensorDataset(x[:512], y[:512]), batch_size=16, shuffle=True)
    val_loader = DataLoader(TensorDataset(x[512:], y[512:]), batch_size=32)
    train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)

    for epoch in range(args.epochs):
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            fabric.backward(loss)
            optimizer.step()
            if batch_idx % 4 == 0:
                fabric.print(f"Train Epoch: {epoch} [{batch_idx}/{len(train_loader)}] "
                             f"Loss: {loss.item():.8f}")
        val = validate(fabric, model, val_loader, args)
        fabric.print(f"Validation: epoch {epoch} loss {val:.8f}")
        save(fabric, epoch, model, optimizer, args)

    if fabric.global_rank == 0:
        torch.save({"model": model.module.state_dict(), "opt": optimizer.state_dict()},
                   args.out)
    fabric.print("FINAL done")


if __name__ == "__main__":
    main()
