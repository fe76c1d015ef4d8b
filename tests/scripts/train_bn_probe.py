"""A BatchNorm model that saves its own copy of the state right after chosen optimizer steps.

cfrun's snapshot of step s must equal this copy bit for bit, although the next forward changes
the BatchNorm statistics and the next step changes the parameters while the snapshot is copied.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

steps, probe_at, out_dir = int(sys.argv[1]), {int(s) for s in sys.argv[2].split(",")}, sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 512),
                      nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
step = 0
while step < steps:
    x = torch.randn(256, 64)
    y = torch.randint(0, 10, (256,))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step in probe_at:
        copy = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()]}
        torch.save(copy, os.path.join(out_dir, f"probe-{step}.pt"))
print("done", step)
