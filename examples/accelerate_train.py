"""Train a small MLP on scikit-learn's digits with a Hugging Face ``accelerate`` loop.

The loop people write with ``accelerate``: ``accelerator.prepare`` wraps the model, optimizer and
DataLoader, ``accelerator.backward`` replaces ``loss.backward()``. It knows nothing about cfrun:

    python examples/accelerate_train.py --out acc.pt
    cfrun --interval 10 examples/accelerate_train.py --out acc.pt
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default="acc.pt")
    args = p.parse_args()

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    loader = DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=32, shuffle=True,
                        drop_last=True)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        for i, (xb, yb) in enumerate(loader):
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            if i % 10 == 9:
                print(f"epoch {epoch} batch {i + 1} loss {running / 10:.6f}")
                running = 0.0
    torch.save(accelerator.unwrap_model(model).state_dict(), args.out)
    print(f"FINAL loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
