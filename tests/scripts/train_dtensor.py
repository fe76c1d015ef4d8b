"""A model cfrun cannot checkpoint (issue 18, item 9), on a 1-rank process group. ``distribute``
(default): parameters made DTensors by ``distribute_module`` on a CPU device mesh (as tensor
parallelism makes them); ``fsdp2``: FSDP2's ``fully_shard`` on a CPU device mesh; ``fsdp1``:
``FullyShardedDataParallel`` (needs a GPU). Trains a few steps and prints ``DONE``."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

kind = sys.argv[1] if len(sys.argv) > 1 else "distribute"
cuda = kind == "fsdp1"
dist.init_process_group("nccl" if cuda else "gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
if kind == "distribute":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = distribute_module(
        model, mesh, input_fn=lambda mod, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()]) for x in inputs))
elif kind == "fsdp2":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
else:
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.cuda.set_device(0)
    model = FullyShardedDataParallel(model.cuda(), device_id=0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    x = torch.randn(8, 16, device="cuda" if cuda else "cpu")
    out = model(x)
    loss = (out.to_local() if kind == "distribute" else out).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("DONE", flush=True)
dist.destroy_process_group()
