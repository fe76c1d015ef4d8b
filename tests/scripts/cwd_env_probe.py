"""Appends its cwd and OMP_NUM_THREADS to the file argv[1] (a relative path lands in the cwd),
trains 10 steps, fails after step 7 in attempt 0 only."""
import json
import os
import sys

import torch
import torch.nn as nn


def cfrun_attempt() -> str:
    """cfrun's attempt number, read afresh (a module variable is restored on resume)."""
    return str(json.loads(os.environ["CFRUN_RANK_SETTINGS"])["attempt"])


attempt = cfrun_attempt()
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"cwd": os.getcwd(), "omp": os.environ.get("OMP_NUM_THREADS"),
                        "attempt": attempt}) + "\n")
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(10):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if it + 1 == 7 and cfrun_attempt() == "0":
        raise ValueError("fails once")
print("FINAL done")
