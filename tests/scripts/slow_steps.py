"""A step loop that sleeps in each iteration (for preemption tests); optional hang at a step.

argv: steps, out, sleep_s, [hang_at_step]. With ``SLOW_STEPS_STOP_FILE`` set, the loop ends
early at the first step that finds that file (a test ends a long run once it saw what it waits
for, however slow the machine).
"""
import os
import sys
import time

import torch
import torch.nn as nn

steps, out, sleep_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
hang_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
stop_file = os.environ.get("SLOW_STEPS_STOP_FILE")
torch.manual_seed(5)
model = nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for it in range(steps):
    if stop_file and os.path.exists(stop_file):
        break
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {it + 1}", flush=True)
    if it + 1 == hang_at and not os.path.exists(out + ".hung"):
        open(out + ".hung", "w").close()
        time.sleep(3600)
    time.sleep(sleep_s)
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print("FINAL done")
