"""Draws from python's random module, which it never seeds: every run draws other numbers.
cfrun verify: not exact, RNG python random."""
import random

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(300):
    noise = random.random()
    loss = (model(torch.randn(8, 4)) * (1 + noise)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
