"""Trains a small model for ``--steps`` optimizer steps and prints one line per step on stdout
and one on stderr, and what its streams are (a terminal or not, its size): the ranks' console
for the tests of the output kept in the job dir (``logs/attempt-N-output.log``). ``--bulk N``
prints N bytes more on stdout before the first step. ``PLANT_LINK=LINK:TARGET`` in the
environment: the first attempt makes LINK a symbolic link to TARGET (a planted link)."""

import argparse
import os
import sys

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--bulk", type=int, default=0)
args = p.parse_args()

size = os.get_terminal_size() if sys.stdout.isatty() else None
print(f"stdout tty={sys.stdout.isatty()} stderr tty={sys.stderr.isatty()} size={size}",
      flush=True)
plant = os.environ.get("PLANT_LINK")
if plant and not os.path.lexists(plant.split(":")[0]):
    os.symlink(plant.split(":")[1], plant.split(":")[0])
if args.bulk:
    sys.stdout.write("x" * (args.bulk - 1) + "\n")
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, args.steps + 1):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"out {step}", flush=True)
    print(f"err {step}", file=sys.stderr, flush=True)
