"""Halves its learning rate when it finds itself in a new process, as a script that reads the
wall clock and treats a pause as a restart would (a warm spare resumes in well under a second,
so the clock no longer tells a restart reliably; stop 44's CI): after a resume it trains
differently. cfrun verify: not exact, first difference `lr`."""
import os

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
lr = 0.05
pid = os.getpid()
for step in range(300):
    if os.getpid() != pid:  # pid is read before it is assigned: a script variable, stored
        lr = lr / 2
        for group in opt.param_groups:
            group["lr"] = lr
    pid = os.getpid()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
