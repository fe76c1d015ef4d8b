"""A DataLoader trainer whose model, optimizer grouping and scheduler come from the environment,
so that a test can change the job between a crash and its resume without changing the command:
$WIDTH (hidden layer width, default 16), $GROUPS (1: one parameter group, 2: one per layer),
$SCHED (step: StepLR, exp: ExponentialLR). argv: epochs (8 steps each), output file."""
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

epochs, out = int(sys.argv[1]), sys.argv[2]
width = int(os.environ.get("WIDTH", "16"))
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))
if os.environ.get("GROUPS", "1") == "2":
    params = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
else:
    params = [{"params": model.parameters()}]
opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
if os.environ.get("SCHED", "step") == "exp":
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
else:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))
loader = DataLoader(data, batch_size=8, shuffle=True)
for epoch in range(epochs):
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sched.step()
    print(f"epoch {epoch} loss {loss.item():.8f}", flush=True)
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print(f"FINAL {loss.item():.8f}")
