"""A step loop that must run as a plain `python script.py`: like scripts that call
``init_process_group("nccl")`` whenever ``RANK`` is set, it fails at once when it sees torchrun's
variables (for ``--launcher python``).

argv: steps, out, sleep_s
"""
import os
import sys
import time

import torch
import torch.nn as nn

seen = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if k in os.environ]
if seen:
    raise RuntimeError(f"launched as a distributed rank ({', '.join(seen)} set); "
                       "this script runs as plain python")
steps, out, sleep_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
torch.manual_seed(5)
torch.set_num_threads(1)
model = nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for it in range(steps):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {it + 1}", flush=True)
    time.sleep(sleep_s)
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print("FINAL done")
