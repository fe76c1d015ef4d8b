"""Records how long each step took (``step_times``, ``t_prev`` from ``time.perf_counter()``)
and computes identically in every run: its parameters never read the clock. cfrun verify:
exact, with the timing variables named apart (issue 27, item 6). With ``clock`` as its
argument the loss reads the clock too: not exact."""
import sys
import time

import torch

torch.manual_seed(0)
clock = sys.argv[1:] == ["clock"]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
step_times = []
t_prev = time.perf_counter()
for step in range(40):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    if clock:
        loss = loss * (1 + (time.perf_counter() % 1e-3))
    opt.zero_grad()
    loss.backward()
    opt.step()
    now = time.perf_counter()
    step_times.append(now - t_prev)
    t_prev = now
