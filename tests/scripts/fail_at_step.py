"""Raises the same error at the same step in every attempt (a deterministic bug)."""
import sys

import torch
import torch.nn as nn

model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(100):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if it + 1 == int(sys.argv[1]):
        raise ValueError(f"bad batch at step {it + 1}")
