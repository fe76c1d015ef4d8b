"""Training script timed by ``bench/gpu_shaped.py`` (not meant to be run by hand).

A GPU-shaped step on a CPU (issue 33): the host thread does what it does in a GPU step and the
"device" is a wait that holds no GIL, so that what cfrun adds on the host (its hooks, the
snapshot thread's hold on the GIL, the persist agent's memory traffic) shows up as step time:

* ``--launches`` small ops (forward and backward: each a tiny tensor op through the dispatcher,
  as a kernel launch costs the host a few microseconds);
* a wait of ``--device-ms`` without the GIL (``time.sleep``: the host blocked in
  ``cudaStreamSynchronize`` / ``loss.item()``);
* ``loss.item()`` and ``optimizer.step()`` (SGD with momentum; only the small parameters get
  gradients, as on a GPU the update itself is device work);
* a state of ``--state-mb`` megabytes in parameters the optimizer holds (the bulk of a model's
  bytes: copied by every snapshot and written by every persist).

Prints ``RESULT {"iter_ms": [...], "state_bytes": N}`` with the host time between loop-body
starts of every iteration after the first 20 (warm-up).
"""

import argparse
import json
import time

import torch
import torch.nn as nn

WARMUP_ITERS = 20

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--launches", type=int, default=300)
p.add_argument("--device-ms", type=float, default=60.0)
p.add_argument("--state-mb", type=float, default=256.0)
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)


class Shaped(nn.Module):
    def __init__(self, launches: int, state_mb: float) -> None:
        super().__init__()
        self.small = nn.ParameterList(nn.Parameter(torch.randn(8)) for _ in range(launches // 2))
        n_bulk = 64
        per = max(1, int(state_mb * 1e6 / 4 / n_bulk))
        self.bulk = nn.ParameterList(nn.Parameter(torch.randn(per)) for _ in range(n_bulk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for q in self.small:
            x = x * q + 1.0
        return x.square().mean()


model = Shaped(args.launches, args.state_mb)
opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
state_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
stamps = []
for _step in range(args.steps):
    stamps.append(time.perf_counter())
    loss = model(torch.ones(8))
    opt.zero_grad()
    loss.backward()
    time.sleep(args.device_ms / 1e3)  # the device runs what was launched; the host waits
    loss.item()
    opt.step()
stamps.append(time.perf_counter())
iter_ms = [(b - a) * 1e3 for a, b in zip(stamps[WARMUP_ITERS:], stamps[WARMUP_ITERS + 1:])]
print("RESULT " + json.dumps({"iter_ms": iter_ms, "state_bytes": state_bytes}), flush=True)
