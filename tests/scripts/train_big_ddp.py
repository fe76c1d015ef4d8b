"""A 2-rank DDP trainer with a large state (issue 18, item 10: host memory on resume).

Two 4096x4096 layers (~134 MB of float32 parameters) and SGD momentum (as much again): about
268 MB of state per rank, split 1/N between the ranks' shards by cfrun. After the first
optimizer step a process takes (on a resume, the first after the restore: cfrun reads the
checkpoint from ``import torch`` on, in the background, and applies it at the loop head) each
rank appends ``rank VmHWM_kB`` to $MEM_LOG: the process's peak resident memory so far, which
on a resume includes the checkpoint's load. Prints ``STATE_BYTES n`` (parameters plus
momentum) at the end.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn


def peak_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
steps = int(os.environ.get("STEPS", "8"))
for step in range(steps):
    x = torch.randn(4, 4096)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if "TRAIN_BIG_LOGGED" not in os.environ:  # once per process: cfrun restores a script
        os.environ["TRAIN_BIG_LOGGED"] = "1"  # variable such as `logged`, not the environment
        with open(os.environ["MEM_LOG"], "a") as log:
            log.write(f"{os.environ['RANK']} {peak_rss_kb()}\n")
state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
state_bytes += sum(v.numel() * v.element_size() for st in opt.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))
if rank == 0:
    print(f"STATE_BYTES {state_bytes}", flush=True)
dist.destroy_process_group()
