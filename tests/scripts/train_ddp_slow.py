"""An unmodified 2-rank DDP trainer that sleeps each step (for preemption tests with ranks).

argv: out, sleep_s[, epochs (2; 32 steps each)]. Rank 0 saves the model and optimizer state at the end, then prints
"FINAL done" (a preempted run must never get there).
"""
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

out, sleep_s = sys.argv[1], float(sys.argv[2])
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
x = torch.randn(1024, 32)
y = (x[:, :4].sum(1) > 0).long()
ds = TensorDataset(x, y)
sampler = DistributedSampler(ds, shuffle=True, seed=1)
loader = DataLoader(ds, batch_size=16, sampler=sampler, drop_last=True)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(),
                                                          nn.Linear(64, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(sleep_s)
if rank == 0:
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, out)
    print("FINAL done", flush=True)
dist.destroy_process_group()
