"""An unmodified language-model trainer in the shape of the classic word-level LM example: the
token stream is one tensor, ``train()`` walks it with
``for batch, i in enumerate(range(0, n - 1, bptt))`` (no DataLoader), and the module-level
epoch loop calls ``train()`` and ``evaluate()``.

``train_lm_bptt.py EPOCHS OUT [SHAPE]``: SHAPE ``enumerate`` (default), ``zip``
(``for batch, i in zip(itertools.count(), range(...))``) or ``range`` (``for i in range(a, b,
step)`` with the batch counted by hand). Prints one line per batch (with the batch counter)
and per epoch. ``ITER_LOG``: one line per training iteration.
"""

import itertools
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

epochs, out = int(sys.argv[1]), sys.argv[2]
shape = sys.argv[3] if len(sys.argv) > 3 else "enumerate"
iter_log = os.environ.get("ITER_LOG")
torch.manual_seed(1)
ntokens, bptt, bsz = 50, 7, 4
train_data = torch.randint(0, ntokens, (213, bsz))
val_data = torch.randint(0, ntokens, (43, bsz))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ntokens, 16)
        self.drop = nn.Dropout(0.2)
        self.rnn = nn.GRU(16, 16)
        self.out = nn.Linear(16, ntokens)

    def forward(self, x):
        h, _ = self.rnn(self.drop(self.emb(x)))
        return self.out(self.drop(h))


model = TinyLM()
opt = torch.optim.SGD(model.parameters(), lr=0.5)


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def step(epoch, batch, i, total):
    data, targets = get_batch(train_data, i)
    loss = F.cross_entropy(model(data).view(-1, ntokens), targets)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    opt.step()
    print(f"batch {epoch}:{batch} i {i} loss {loss.item():.8f}", flush=True)
    if iter_log:
        with open(iter_log, "a") as f:
            f.write(f"{epoch}:{batch}\n")
    return total + loss.item()


def train(epoch):
    model.train()
    total = 0.0
    if shape == "enumerate":
        for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
            total = step(epoch, batch, i, total)
    elif shape == "zip":
        for batch, i in zip(itertools.count(), range(0, train_data.size(0) - 1, bptt)):
            total = step(epoch, batch, i, total)
    else:
        batch = 0
        for i in range(0, train_data.size(0) - 1, bptt):
            total = step(epoch, batch, i, total)
            batch += 1
    return total


def evaluate(source):
    model.eval()
    with torch.no_grad():
        return sum(F.cross_entropy(model(d).view(-1, ntokens), t).item()
                   for d, t in (get_batch(source, i) for i in range(0, source.size(0) - 1, bptt)))


for epoch in range(1, epochs + 1):
    total = train(epoch)
    val = evaluate(val_data)
    print(f"epoch {epoch} loss {total:.8f} val {val:.8f}", flush=True)
    for g in opt.param_groups:
        g["lr"] *= 0.5
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out)
print(f"FINAL loss {total:.8f} val {val:.8f}")
