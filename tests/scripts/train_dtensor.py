"""A model whose parameters are DTensors (as FSDP2's fully_shard and tensor parallelism make
them), on a 1-rank gloo group with a CPU device mesh (issue 18, item 9). Trains a few steps and
prints ``DONE``."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = distribute_module(
    nn.Linear(16, 4), mesh,
    input_fn=lambda mod, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()])
                                             for x in inputs))
assert all(isinstance(p, DTensor) for p in model.parameters())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    x = torch.randn(8, 16)
    loss = model(x).to_local().square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("DONE", flush=True)
dist.destroy_process_group()
