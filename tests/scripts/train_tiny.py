"""An unmodified loader-based trainer for cfrun's crash tests (digits, BatchNorm, 2 workers).

Draws from the torch, numpy and python RNGs in the workers' augmentation and in the main loop.
Writes the final model + optimizer state to --out, prints per-epoch metrics, appends one line per
training iteration to $ITER_LOG and one per training sample loaded to $GETITEM_LOG (the loading
worker's training process's pid, the sample index), and SIGKILLs itself once inside the validation loop of epoch
$DIE_IN_VAL_EPOCH (marker file $DIE_MARKER makes it once per job).
"""

import argparse
import os
import random
import signal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from digits import load_digits  # sklearn.datasets.load_digits, without importing sklearn
from torch.utils.data import DataLoader, TensorDataset

best_acc = 0.0
GETITEM_LOG = os.environ.get("GETITEM_LOG")
# the training process (a loader worker inherits it): a worker orphaned by its rank's
# SIGKILL, reparented to a subreaper, logs the same pid for the samples it still loads
TRAINING_PID = os.getpid()


class Augmented(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        if GETITEM_LOG:  # which process loaded which sample
            with open(GETITEM_LOG, "a") as f:
                f.write(f"{TRAINING_PID} {i}\n")
        # all three RNGs a worker has: torch, numpy, python
        shift = 0.05 * float(np.random.rand()) + 0.05 * random.random()
        return x + 0.1 * torch.randn_like(x) + shift, y


def validate(model, loader, epoch):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i == 1 and epoch == int(os.environ.get("DIE_IN_VAL_EPOCH", "-1")):
                marker = os.environ["DIE_MARKER"]
                if not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            correct += (model(x).argmax(1) == y).sum().item()
            total += y.numel()
    model.train()
    return correct / total


def main():
    global best_acc
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    torch.set_num_threads(1)
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    train = Augmented(x[:1500], y[:1500])
    val = TensorDataset(x[1500:], y[1500:])
    train_loader = DataLoader(train, batch_size=64, shuffle=True, drop_last=True,
                              num_workers=args.workers)
    val_loader = DataLoader(val, batch_size=64)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    iter_log = os.environ.get("ITER_LOG")
    for epoch in range(args.epochs):
        total_loss = 0.0
        for i, (xb, yb) in enumerate(train_loader):
            # the main process's python and numpy RNGs as well (torch's: dropout)
            weight = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
            loss = weight * F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss.item()
            if iter_log:
                with open(iter_log, "a") as f:
                    f.write(f"{epoch} {i}\n")
        sched.step()
        acc = validate(model, val_loader, epoch)
        best_acc = max(best_acc, acc)
        print(f"epoch {epoch} loss {total_loss / (i + 1):.8f} acc {acc:.6f} best {best_acc:.6f}",
              flush=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, args.out)
    print(f"FINAL loss {total_loss / (i + 1):.8f} acc {acc:.6f} best {best_acc:.6f}")


if __name__ == "__main__":
    main()
