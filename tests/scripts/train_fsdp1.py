"""A model cfrun refuses to checkpoint (issue 18, item 9; issue 25): FSDP1's
``FullyShardedDataParallel`` on a 1-rank group (argv[1] ``fsdp1``: gloo on CPU; ``fsdp1-cuda``:
NCCL on GPU 0). DTensor states (FSDP2, tensor parallelism) are checkpointed: train_fsdp2.py.
Trains a few steps and prints ``DONE``."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel

cuda = sys.argv[1:] == ["fsdp1-cuda"]
dist.init_process_group("nccl" if cuda else "gloo")
torch.manual_seed(0)
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
model = FullyShardedDataParallel(
    nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(device), device_id=device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(8, 16, device=device)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("DONE", flush=True)
dist.destroy_process_group()
