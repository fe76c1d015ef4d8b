"""Scripts cfrun cannot resume exactly; ``not_exact.py MODE STEPS`` (README, "What is not exact").

MODE ``next``: an IterableDataset loader advanced with ``next()`` in a ``while`` loop, and an
open file in a script variable. ``for_list``: a step loop over a list of batches. ``trace``: a
``for range`` step loop with a tracer (``sys.settrace``) active.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

mode = sys.argv[1]
steps = int(sys.argv[2])
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(xb):
    loss = F.mse_loss(model(xb), xb.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(4, generator=g)


if mode == "next":
    log = open("train.log", "w")
    it = iter(DataLoader(Stream(), batch_size=8))
    step = 0
    while step < steps:
        xb = next(it)
        log.write(f"{train_step(xb)}\n")
        step += 1
elif mode == "for_list":
    batches = [torch.randn(8, 4) for _ in range(steps)]
    for xb in batches:
        train_step(xb)
elif mode == "trace":
    sys.settrace(lambda frame, event, arg: None)
    for i in range(steps):
        train_step(torch.randn(8, 4))
    sys.settrace(None)
print("FINAL done")
