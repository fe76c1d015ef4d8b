"""nanoGPT's start: DDP (``init_process_group("nccl")``) whenever ``RANK`` is set, as torchrun
sets it; without NCCL (a CPU machine) that fails before the first optimizer step. Its README
says ``python train.py``: as plain python it trains (issue 37, item 1).

argv: steps, out
"""
import os
import sys

import torch
import torch.nn as nn

if int(os.environ.get("RANK", -1)) != -1:  # nanoGPT's test for a DDP run
    from torch.distributed import init_process_group

    init_process_group(backend="nccl")
steps, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(5)
torch.set_num_threads(1)
model = nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for it in range(steps):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print("FINAL done")
