"""Training script timed by ``bench/step_overhead.py`` (not meant to be run by hand).

A plain PyTorch script that knows nothing about cfrun, whose step costs as little as a step
can: a 32 -> 32 -> 10 MLP, SGD, batches of 8 from a tensor in memory, ``torch.set_num_threads(1)``.
``--loader``: the batches come from a ``DataLoader`` (cfrun also hooks its ``next()``);
otherwise the loop indexes a tensor (a step loop). Prints one JSON line: ``step_us``, the
time between consecutive arrivals at the top of the loop body of every iteration after the
first 200, in microseconds, and ``cpu_us``, the training thread's CPU time over the same
intervals (``time.thread_time``: what the step costs, whatever else the machine runs).
"""

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3000)
p.add_argument("--loader", action="store_true")
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)
x = torch.randn(args.steps * 8, 32)
y = torch.randint(0, 10, (args.steps * 8,))
model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stamps = []
cpu = []
if args.loader:
    batches = DataLoader(TensorDataset(x, y), batch_size=8)
    for xb, yb in batches:
        stamps.append(time.perf_counter())
        cpu.append(time.thread_time())
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
else:
    for i in range(args.steps):
        stamps.append(time.perf_counter())
        cpu.append(time.thread_time())
        xb, yb = x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
stamps.append(time.perf_counter())
cpu.append(time.thread_time())
steps_us = [(b - a) * 1e6 for a, b in zip(stamps[200:], stamps[201:])]
cpu_us = [(b - a) * 1e6 for a, b in zip(cpu[200:], cpu[201:])]
print(json.dumps({"step_us": steps_us, "cpu_us": cpu_us}), flush=True)
