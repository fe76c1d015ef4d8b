"""A small trainer whose own options abbreviate torchrun's (``--d`` of
``--duplicate-stdout-filters``/``--duplicate-stderr-filters``, ``--st`` of ``--standalone``/
``--start-method``, ``--ma`` of ``--master-addr``/``--master-port``/``--max-restarts``,
``--nproc`` of ``--nproc-per-node``): prints ``ARGV`` and its arguments as JSON, then trains a
linear model for ``--steps`` steps (default 200: enough for cfrun profile, whose profiling checkpoints a loaded machine defers) and prints ``FINAL`` with its weights' sum.
"""

import argparse
import json
import sys

import torch

print("ARGV " + json.dumps(sys.argv[1:]), flush=True)
parser = argparse.ArgumentParser()
for name in ("--d", "--st", "--ma", "--nproc", "--steps"):
    parser.add_argument(name, type=int, default=200 if name == "--steps" else 0)
args = parser.parse_args()
torch.manual_seed(args.d)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for _ in range(args.steps):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"FINAL {model.weight.sum().item():.6f}", flush=True)
