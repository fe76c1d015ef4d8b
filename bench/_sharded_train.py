"""DDP trainer for bench/sharded_persist.py: an MLP (~25 M parameters with --hidden 3500,
~200 MB of parameters + SGD momentum), gloo, synthetic batches. Rank 0 prints ms_per_iter."""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--hidden", type=int, default=2500)
args = ap.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
torch.set_num_threads(1)
h = args.hidden
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(256, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(dist.get_rank())
stamps = []
for _step in range(args.steps):
    stamps.append(time.perf_counter())
    x = torch.randn(32, 256, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
stamps.append(time.perf_counter())
if dist.get_rank() == 0:
    timed = stamps[5:]
    print(f"ms_per_iter {(timed[-1] - timed[0]) / (len(timed) - 1) * 1e3:.3f}", flush=True)
dist.destroy_process_group()
