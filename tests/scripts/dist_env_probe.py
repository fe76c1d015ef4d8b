"""Writes its whole environment to ``argv[1]-RANK.json``, then joins the gloo group of its
launcher (``env://``), all-reduces its rank and trains 3 DDP steps: the environment a launcher
gives its ranks, compared between torchrun and cfrun's ``--launcher python``."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

with open(f"{sys.argv[1]}-{os.environ['RANK']}.json", "w") as f:
    json.dump(dict(os.environ), f)
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank()])
dist.all_reduce(total)
assert total.item() == sum(range(dist.get_world_size()))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
dist.destroy_process_group()
print("FINAL done")
