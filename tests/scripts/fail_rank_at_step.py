"""2-rank DDP (gloo): only rank argv[2] raises ValueError after step argv[1], in every attempt;
the other rank then fails in its next all-reduce (a transport error naming a changing port)."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(100):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if it + 1 == int(sys.argv[1]) and rank == int(sys.argv[2]):
        raise ValueError(f"bad batch at step {it + 1} on rank {rank}")
dist.destroy_process_group()
