"""An unmodified 2-rank DDP trainer with a DistributedSampler (set_epoch each epoch)."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from digits import load_digits  # sklearn.datasets.load_digits, without importing sklearn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
d = load_digits()
x = torch.tensor(d.data, dtype=torch.float32) / 16.0
y = torch.tensor(d.target)
ds = TensorDataset(x[:1500], y[:1500])
sampler = DistributedSampler(ds, shuffle=True, seed=1)
loader = DataLoader(ds, batch_size=32, sampler=sampler, drop_last=True)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 384), nn.ReLU(), nn.Linear(384, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        print(f"epoch {epoch} loss {loss.item():.8f}", flush=True)
if rank == 0:
    torch.save(model.module.state_dict(), sys.argv[1])
dist.destroy_process_group()
