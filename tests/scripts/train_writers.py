"""A trainer that writes tensors between an optimizer step and the next one, the ways scripts
do (issue 33): weights decayed or clamped in place under ``no_grad`` right after the step, a
``torch._foreach_`` update of the parameters, an EMA copy of the model updated after the step,
a forward hook that counts calls in a buffer, BatchNorm statistics, a CPU GradScaler.

The writers run at the top of the loop body, after the loop head where cfrun takes its
checkpoints and before the optimizer step whose gate waits for the copy. ``--writer`` picks
one (``all``: every one). At the loop head the script saves its own copy of the model and
optimizer state to ``<probe-dir>/probe-<step>.pt`` (only with ``--probe-dir``): cfrun's
checkpoint of that step must equal it bit for bit. Writes the final state to ``--out``. Deterministic, CPU."""
import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--writer", default="all",
               choices=["all", "decay", "clamp", "foreach", "ema", "hook", "bn", "scaler"])
p.add_argument("--steps", type=int, default=40)
p.add_argument("--probe-dir", default=None)
p.add_argument("--out", required=True)
args = p.parse_args()
w = args.writer

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
ema = copy.deepcopy(model).requires_grad_(False) if w in ("all", "ema") else None
scaler = torch.amp.GradScaler("cpu", growth_interval=3) if w in ("all", "scaler") else None
counter = model[0]
counter.register_buffer("calls", torch.zeros((), dtype=torch.int64))


def count_calls(module, inputs, output):
    module.calls.add_(1)


if w in ("all", "hook"):
    counter.register_forward_hook(count_calls)
if w not in ("all", "bn"):
    model[1].track_running_stats = False
    model[1].running_mean = model[1].running_var = None

step = 0
while step < args.steps:
    # the loop head: cfrun's checkpoint of `step` holds the state as it is here
    if args.probe_dir and step:
        torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "opt": [{k: v.clone() for k, v in opt.state[q].items()}
                            for q in model.parameters()]},
                   os.path.join(args.probe_dir, f"probe-{step}.pt"))
    # written after the checkpoint's boundary and before the next optimizer step
    with torch.no_grad():
        if w in ("all", "decay"):
            for q in model[0].parameters():
                q.mul_(0.99)
        if w in ("all", "clamp"):
            for q in model[3].parameters():
                q.clamp_(-0.03, 0.03)
        if w in ("all", "foreach"):
            torch._foreach_mul_(list(model[1].parameters()), 0.999)
        if ema is not None:
            for e, q in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9).add_(q, alpha=0.1)
    x = torch.randn(64, 32)
    y = torch.randint(0, 8, (64,))
    loss = F.cross_entropy(model(x), y)  # BatchNorm statistics, the hook's buffer
    opt.zero_grad()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    step += 1

state = {"model": model.state_dict(), "opt": opt.state_dict()}
if ema is not None:
    state["ema"] = ema.state_dict()
if scaler is not None:
    state["scaler"] = scaler.state_dict()
torch.save(state, args.out)
print("done", step)
