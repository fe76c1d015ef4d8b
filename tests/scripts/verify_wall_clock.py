"""Reads the wall clock and halves its learning rate after a pause of more than a second (a
restart is one): after a resume it trains differently. cfrun verify: not exact."""
import time

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
lr = 0.05
last = time.time()
for step in range(300):
    now = time.time()
    if now - last > 1.0:
        lr = lr / 2
        for group in opt.param_groups:
            group["lr"] = lr
    last = now
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
