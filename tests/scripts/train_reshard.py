"""An unmodified data-parallel trainer that runs on any world size with the same global batch
(issue 25, item 4: ``--reshard``): ``KIND`` (argv[1]) is ``ddp`` or ``fsdp2`` (``fully_shard``
on each layer and the root). 384 samples of digits, a global batch of 32 split over the
ranks (12 steps an epoch on any world size that divides 32), a DistributedSampler, Adam.

Every step, each rank appends the dataset indices it trained on to ``seen-RUN-rankR.txt``
(``STEP EPOCH WORLD i,j,...``; RUN: the unix time rank 0 started, the same on every rank, so
a test takes each step from the last run that trained it) and rank 0 prints the mean loss
over the ranks (``loss STEP WORLD VALUE``): a test counts the samples of an epoch and follows
the loss across world sizes. The model's full weights are
saved at the end to argv[2] by rank 0."""
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from digits import load_digits  # sklearn.datasets.load_digits, without importing sklearn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

kind, out = sys.argv[1], sys.argv[2]
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
run = torch.tensor([time.time()], dtype=torch.float64)
dist.broadcast(run, 0)
seen_log = open(f"seen-{int(run.item() * 1000)}-rank{rank}.txt", "a")
torch.manual_seed(0)
torch.set_num_threads(1)
d = load_digits()
x = torch.tensor(d.data[:384], dtype=torch.float32) / 16.0
y = torch.tensor(d.target[:384])
ds = TensorDataset(torch.arange(384), x, y)
model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10))
if kind == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
elif kind == "fsdp2":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
else:
    raise SystemExit(f"unknown kind {kind}")
sampler = DistributedSampler(ds, shuffle=True, seed=3)
loader = DataLoader(ds, batch_size=32 // world, sampler=sampler, drop_last=True)
opt = torch.optim.Adam(model.parameters(), lr=3e-3)

step = 0
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for idx, xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(step, epoch, world, ",".join(map(str, idx.tolist())), file=seen_log, flush=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"loss {step} {world} {mean.item() / world:.8f}", flush=True)

full = model.module.state_dict() if kind == "ddp" else {
    k: v.full_tensor() for k, v in model.state_dict().items()}
if rank == 0:
    torch.save(full, out)
    print(f"FINAL {loss.item():.8f}", flush=True)
dist.destroy_process_group()
