"""Trains a few steps, finishes, then dies in interpreter teardown (``abort``: SIGABRT from an
atexit handler that runs after cfrun's, as torch+gloo's C++ destructors sometimes do) or exits
with a code of its own (``exit3``: ``sys.exit(3)`` after training).

argv: mode, out
"""
import atexit
import os
import sys

mode, out = sys.argv[1], sys.argv[2]
if mode == "abort":
    atexit.register(os.abort)  # registered before torch's import: runs after cfrun's handler
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

torch.manual_seed(3)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(30):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.save(model.state_dict(), out)
print("FINAL done", flush=True)
if mode == "exit3":
    sys.exit(3)
