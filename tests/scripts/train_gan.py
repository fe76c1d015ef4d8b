"""An unmodified GAN on digits: two models, two Adam optimizers stepped every iteration, a
GradScaler per optimizer (enabled on CPU), a per-iteration LR scheduler for G. Writes the final
states to argv[1]."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from digits import load_digits  # sklearn.datasets.load_digits, without importing sklearn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
torch.set_num_threads(1)
x = torch.tensor(load_digits().data, dtype=torch.float32) / 8.0 - 1.0
loader = DataLoader(TensorDataset(x), batch_size=64, shuffle=True, drop_last=True)
G = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh())
D = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Dropout(0.2), nn.Linear(64, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
sched_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, gamma=0.995)
scaler_g = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
scaler_d = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
for epoch in range(3):
    for (real,) in loader:
        z = torch.randn(real.shape[0], 16)
        fake = G(z)
        d_loss = (F.softplus(-D(real)) + F.softplus(D(fake.detach()))).mean()
        opt_d.zero_grad()
        scaler_d.scale(d_loss).backward()
        scaler_d.step(opt_d)
        scaler_d.update()
        g_loss = F.softplus(-D(fake)).mean()
        opt_g.zero_grad()
        scaler_g.scale(g_loss).backward()
        scaler_g.step(opt_g)
        scaler_g.update()
        sched_g.step()
    print(f"epoch {epoch} d {d_loss.item():.8f} g {g_loss.item():.8f}", flush=True)
torch.save({"G": G.state_dict(), "D": D.state_dict(), "opt_g": opt_g.state_dict(),
            "opt_d": opt_d.state_dict(), "sched_g": sched_g.state_dict(),
            "scaler_g": scaler_g.state_dict(), "scaler_d": scaler_d.state_dict()}, sys.argv[1])
print(f"FINAL d {d_loss.item():.8f} g {g_loss.item():.8f}")
