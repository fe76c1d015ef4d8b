"""Trains until it has received every signal named in argv[2:] (appending each name to the
file argv[1] as it arrives); exits 1 if they do not all come within 60 s."""
import signal
import sys
import time

import torch
import torch.nn as nn

out, wanted = sys.argv[1], set(sys.argv[2:])
got = []


def note(signum, frame):
    got.append(signal.Signals(signum).name)
    with open(out, "a") as f:
        f.write(signal.Signals(signum).name + "\n")


for name in wanted:
    signal.signal(getattr(signal, name), note)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
deadline = time.time() + 60
while not wanted <= set(got):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    time.sleep(0.05)
    if time.time() > deadline:
        sys.exit(1)
print("FINAL got", sorted(set(got)))
