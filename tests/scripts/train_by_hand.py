"""Updates its parameters by hand (``p.data.add_(p.grad, alpha=-lr)``), no torch.optim
optimizer; with argv[2] == "opt" it uses torch.optim.SGD instead (the same update).

argv: steps, [opt]
"""
import sys

import torch
import torch.nn as nn

steps = int(sys.argv[1])
use_opt = len(sys.argv) > 2 and sys.argv[2] == "opt"
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01) if use_opt else None
for it in range(steps):
    x = torch.randn(8, 16)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    model.zero_grad()
    loss.backward()
    if opt is not None:
        opt.step()
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.01)
print(f"FINAL loss {loss.item():.6f}")
