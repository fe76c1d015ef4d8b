"""Prints one line per optimizer step of a small model, for ever (``cfrun print_lines.py |
head -3``: its stdout's reader goes away)."""

import torch

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0
while True:
    loss = model(torch.randn(2, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    print(f"step {step}", flush=True)
