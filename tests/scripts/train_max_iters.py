"""An unmodified step loop shaped like nanoGPT's: module-level settings overridden as
``--name=value`` (its configurator), ``while True`` with ``iter_num`` counted from 0 and
``if iter_num > max_iters: break`` after the step; with ``--shape=while`` the bound is the
loop's own test instead (``while iter_num < max_iters``). Saves the model to ``out``."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

max_iters = 40
shape = "break"
out = "max_iters.pt"
for arg in sys.argv[1:]:  # nanoGPT's configurator: --key=value overrides a global
    key, value = arg[2:].split("=", 1)
    globals()[key] = type(globals()[key])(value)

torch.manual_seed(5)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
iter_num = 0


def step() -> None:
    xb = torch.randn(16, 8)
    loss = F.mse_loss(model(xb), xb.sum(1, keepdim=True))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


if shape == "while":
    while iter_num < max_iters:
        step()
        iter_num += 1
else:
    while True:
        step()
        iter_num += 1
        if iter_num > max_iters:
            break
torch.save(model.state_dict(), out)
print(f"FINAL iter_num {iter_num}")
