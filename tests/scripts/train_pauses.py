"""An unmodified step-loop trainer whose checkpoint is about 8 MiB (a 1024x1024 layer and its
momentum), pausing after chosen steps until a file exists (creating FILE.waiting meanwhile): tests act
on the job dir while it waits (the full disk of test_full_disk.py). Deterministic: batches from the global RNG.

Usage: train_pauses.py STEPS OUT [STEP:FILE ...]; saves model and optimizer state to OUT and
prints the final loss. A pause that waits over 300 s exits with code 3.
"""

import os
import sys
import time

import torch
import torch.nn as nn

steps, out = int(sys.argv[1]), sys.argv[2]
pauses = {int(k): f for k, f in (a.split(":", 1) for a in sys.argv[3:])}
torch.manual_seed(5)
model = nn.Linear(1024, 1024)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for it in range(steps):
    xb = torch.randn(8, 1024)
    loss = (model(xb) - xb).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    wait_for = pauses.get(it + 1)
    if wait_for and not os.path.exists(wait_for):
        open(wait_for + ".waiting", "w").close()
        deadline = time.time() + 300
        while not os.path.exists(wait_for):
            if time.time() > deadline:
                sys.exit(3)
            time.sleep(0.05)
    time.sleep(0.01)
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print(f"FINAL loss {loss.item():.10f} it {it}")
