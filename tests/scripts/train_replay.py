"""An unmodified loader trainer whose epoch loop is not ``for ... in range(...)``:
``train_replay.py OUT_DIR`` iterates ``list(range(4))``, so cfrun cannot jump it and replays
the completed epochs on resume. Per epoch: StepLR, a validation loop, a metrics line, and the
script's own ``torch.save`` to ``OUT_DIR/epoch-N.pt``.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

out_dir = sys.argv[1]
torch.manual_seed(0)
x = torch.randn(320, 8)
y = x.sum(1, keepdim=True)
train_loader = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=16, shuffle=True)
val_loader = DataLoader(TensorDataset(x[256:], y[256:]), batch_size=16)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
for epoch in list(range(4)):
    total = 0.0
    for xb, yb in train_loader:
        loss = F.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    sched.step()
    model.eval()
    with torch.no_grad():
        val = sum(F.mse_loss(model(xb), yb).item() for xb, yb in val_loader)
    model.train()
    print(f"epoch {epoch} loss {total:.8f} val {val:.8f} lr {sched.get_last_lr()[0]:.6f}",
          flush=True)
    torch.save(model.state_dict(), os.path.join(out_dir, f"epoch-{epoch}.pt"))
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
           os.path.join(out_dir, "final.pt"))
print(f"FINAL loss {total:.8f} val {val:.8f}")
