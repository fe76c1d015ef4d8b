"""An unmodified step-loop trainer: `for it in range(...)`, batches from the global RNG."""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

steps = int(sys.argv[1])
out = sys.argv[2]
torch.manual_seed(3)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
w_true = torch.randn(8, 1)
ema_loss = None
iter_log = os.environ.get("ITER_LOG")
for it in range(steps):
    xb = torch.randn(16, 8)
    yb = xb @ w_true + 0.01 * torch.randn(16, 1)
    loss = F.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ema_loss = loss.item() if ema_loss is None else 0.9 * ema_loss + 0.1 * loss.item()
    if iter_log:
        with open(iter_log, "a") as f:
            f.write(f"{it}\n")
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print(f"FINAL ema_loss {ema_loss:.10f} it {it}")
