"""Trains until the file argv[1] exists (at least argv[2] steps), then 10 more steps; saves the
model to argv[3]. For tests that act on a job while it runs (the attacks of test_trust.py)."""
import os
import sys
import time

import torch
from torch import nn

stop_file, min_steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
step, last, deadline = 0, None, time.time() + 300
while last is None or step < last:
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if last is None and step >= min_steps and (os.path.exists(stop_file) or time.time() > deadline):
        last = step + 10
    time.sleep(0.05)
torch.save(model.state_dict(), out)
print(f"FINAL {step}")
