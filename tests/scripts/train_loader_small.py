"""A small unmodified loader trainer: ``train_loader_small.py BATCH_SIZE OUT`` (3 epochs).

The batch size comes from the command line, so a resume can be given a different one.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

batch_size = int(sys.argv[1])
out = sys.argv[2]
torch.manual_seed(0)
x = torch.randn(256, 8)
y = x.sum(1, keepdim=True)
loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(3):
    total = 0.0
    for xb, yb in loader:
        loss = F.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    print(f"epoch {epoch} loss {total:.8f}", flush=True)
torch.save(model.state_dict(), out)
print(f"FINAL loss {total:.8f}")
