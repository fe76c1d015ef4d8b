"""A small trainer for bench/early_failure.py: argparse options, a linear model, SGD; with
``--fail-at N`` it raises ``KeyError`` right after optimizer step N (a deterministic bug, as a
missing key in a batch dict), and an unknown option is argparse's usage error before any step.
"""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--fail-at", type=int, default=0)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batch = {"x": torch.randn(16, 64)}
for step in range(1, args.steps + 1):
    opt.zero_grad()
    model(batch["x"]).pow(2).mean().backward()
    opt.step()
    if step == args.fail_at:
        print(batch["y"])  # KeyError: 'y'
print("FINAL", step)
