"""An unmodified sharded trainer (issue 25): ``KIND`` (argv[1]) is ``fsdp2`` (``fully_shard``
on each layer and the root), ``fsdp2-mp`` (the same with a ``MixedPrecisionPolicy``: bf16
parameters, fp32 reduce), ``tp`` (``parallelize_module``, colwise then rowwise) or ``fsdp2-tp``
(a 2-D mesh, ``dp`` x ``tp``: TP inside, FSDP2 across). Gloo on CPU, a DistributedSampler over
the data-parallel ranks, Adam, gradient clipping (FSDP2 alone). Prints each step's loss (rank 0)
and saves each rank's local shards (model and optimizer) to ``OUT-rank{R}.pt`` (argv[2]); with
``SAVE_STEPS`` set, also its model's after every step N to ``OUT-rank{R}-stepN.pt``."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

kind, out = sys.argv[1], sys.argv[2]
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(1)
x = torch.randn(384, 32, generator=g)
y = (x[:, :4].sum(1) > 0).long()
ds = TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 2)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, xb: torch.Tensor) -> torch.Tensor:
        self.seen += xb.shape[0]
        return self.head(F.relu(self.w2(F.relu(self.w1(xb)))))


model = Net()
TP_PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
if kind == "tp":
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, TP_PLAN)
    dp_rank, dp_size = 0, 1
elif kind.startswith("fsdp2"):
    if kind == "fsdp2-tp":
        mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], TP_PLAN)
        mesh = mesh2["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if kind == "fsdp2-mp" else MixedPrecisionPolicy()
    for layer in (model.w1, model.w2):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    dp_rank, dp_size = mesh.get_local_rank(), mesh.size()
else:
    raise SystemExit(f"unknown kind {kind}")
sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=2)
loader = DataLoader(ds, batch_size=32 // dp_size, sampler=sampler, drop_last=True)  # 12 steps
opt = torch.optim.Adam(model.parameters(), lr=1e-2)


def local(v: object) -> object:
    return v.to_local() if isinstance(v, DTensor) else v


step = 0
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb).float(), yb)
        opt.zero_grad()
        loss.backward()
        if kind in ("fsdp2", "fsdp2-mp"):  # with TP the head is plain (or on another mesh):
            # clip_grad_norm_ cannot mix its gradient with the TP ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if rank == 0:
            print(f"loss {loss.item():.8f}", flush=True)
        if os.environ.get("SAVE_STEPS"):  # each step's local model shards (cfrun export's test)
            torch.save({k: local(v) for k, v in model.state_dict().items()},
                       f"{out}-rank{rank}-step{step}.pt")

state = {"model": {k: local(v) for k, v in model.state_dict().items()},
         "opt": {k: {n: local(t) for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}}
torch.save(state, f"{out}-rank{rank}.pt")
if rank == 0:
    print(f"FINAL {loss.item():.8f}", flush=True)
dist.destroy_process_group()
