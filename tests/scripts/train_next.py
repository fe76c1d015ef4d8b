"""A step loop that draws its batches with ``next()`` from a DataLoader iterator it holds.

``train_next.py MODE STEPS OUT``. MODE ``for``: ``for step in range(STEPS)``; ``while``: a
``while step < STEPS`` loop with its own counter. Either way the iterator is made before the
loop and made again when an epoch ends (StopIteration), the way step-count trainers (and the
Hugging Face Trainer, inside itself) draw batches. ``shuffle=True``, dropout, 2 batches of
gradient accumulation per step; ``ITER_LOG`` gets one line per step.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

mode, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
x = torch.randn(200, 8)
y = x @ torch.randn(8, 1)
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, drop_last=True)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
iter_log = os.environ.get("ITER_LOG")
it = iter(loader)
epochs = 0
total = 0.0


def get_batch():
    global it, epochs
    try:
        return next(it)
    except StopIteration:
        epochs += 1
        it = iter(loader)
        return next(it)


def train_step(step):
    global total
    opt.zero_grad()
    for _ in range(2):
        xb, yb = get_batch()
        loss = F.mse_loss(model(xb), yb) / 2
        loss.backward()
        total += loss.item()
    opt.step()
    if step % 10 == 9:
        print(f"step {step + 1} epochs {epochs} loss {total:.8f}")
    if iter_log:
        with open(iter_log, "a") as f:
            f.write(f"{step}\n")


if mode == "for":
    for step in range(steps):
        train_step(step)
else:
    step = 0
    while step < steps:
        train_step(step)
        step += 1
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print(f"FINAL total {total:.10f} epochs {epochs}")
