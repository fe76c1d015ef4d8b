"""Keeps its LR schedule's progress in an object cfrun cannot store (it holds a lock): after a
resume the count starts over and the learning rate jumps back. cfrun verify: not exact."""
import threading

import torch


class Meter:
    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
meter = Meter()
for step in range(300):
    with meter.lock:
        meter.count += 1
    lr = 0.05 / meter.count ** 0.5
    for group in opt.param_groups:
        group["lr"] = lr
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
