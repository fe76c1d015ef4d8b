"""A tiny ``accelerate`` loop with ``gradient_accumulation_steps=2`` (tests/integration/test_frameworks.py).

``accelerator.prepare`` wraps model, optimizer, a shuffled DataLoader of 7 batches (an odd count:
the epoch's last batch steps alone, as accelerate syncs at the end of the loader) and a per-step
LambdaLR; ``accelerator.accumulate`` + ``accelerator.backward``; dropout. Prints every batch's
loss and saves the final weights:

    python train_accelerate.py OUT [EPOCHS]
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main():
    out = sys.argv[1]
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    x, y = torch.randn(56, 8), torch.randint(0, 3, (56,))
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for epoch in range(epochs):
        model.train()
        for i, (xb, yb) in enumerate(loader):
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            print(f"epoch {epoch} batch {i} sync {accelerator.sync_gradients:d} "
                  f"loss {loss.item():.8f}")
    torch.save(accelerator.unwrap_model(model).state_dict(), out)
    print(f"FINAL loss {loss.item():.8f}")


if __name__ == "__main__":
    main()
