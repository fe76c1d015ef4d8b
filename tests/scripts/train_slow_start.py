"""A trainer with a slow start-up (issue 23, item 5: the checkpoint's read overlaps it).

Right after ``import torch`` prints ``THREADS a,b`` (the names of the threads beside the main
one: on a resume, cfrun's background read of the checkpoint), sleeps ``$START_SLEEP_S``
seconds (2: a slow import), prints ``MODEL_AT <unix s>`` and builds its model and Adam; 30
steps of a step loop, then saves model and optimizer to ``argv[1]`` and prints ``FINAL``.
"""
import os
import sys
import threading
import time

import torch

others = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
print("THREADS " + ",".join(others), flush=True)
time.sleep(float(os.environ.get("START_SLEEP_S", "2")))
print(f"MODEL_AT {time.time():.4f}", flush=True)
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 256))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(30):
    x = torch.randn(16, 256)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, sys.argv[1])
print(f"FINAL loss {loss.item():.8f}")
