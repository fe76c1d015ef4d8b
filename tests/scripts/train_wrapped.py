"""An unmodified timm-like trainer: ``main()`` runs ``for epoch in range(start, end)`` and calls
``train_one_epoch()``, which iterates a wrapper around the DataLoader with ``enumerate()``.

``train_wrapped.py WRAPPER EPOCHS OUT`` with WRAPPER one of ``prefetcher`` (a class whose
``__iter__`` reads one batch ahead and, like timm's PrefetchLoader, assumes at least one batch),
``generator`` (a device-mover generator function), ``both`` (the generator around the
prefetcher) or ``library`` (a wrapper object from another module, as Lightning Fabric's). Prints one line per batch (with the enumerate counter) and one per epoch; saves the
final model, optimizer and scheduler state to OUT. ``ITER_LOG`` (optional): a file that gets one
line per training iteration; ``EPOCH_LOG`` (optional): a file that gets a line per
``validate()`` and per ``save()`` (each epoch's checkpoint, ``torch.save`` to a temporary file
then ``os.replace``), written with ``os.write`` so that it counts runs whatever cfrun
suppresses; ``SHUFFLE=0``: the training loader does not shuffle;
``EPOCHS=list``: the epoch loop iterates a list (cfrun replays completed epochs instead of
jumping them).
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Prefetcher:
    """Reads one batch ahead; raises UnboundLocalError on an empty loader (as timm's does)."""

    def __init__(self, loader):
        self.loader = loader
        self.mean = torch.zeros(1, 8)

    def __iter__(self):
        first = True
        for next_input, next_target in self.loader:
            next_input = next_input - self.mean  # stands in for .cuda(non_blocking) + normalize
            if not first:
                yield input, target  # noqa: F821, F823 (bound after the first pass)
            else:
                first = False
            input = next_input
            target = next_target
        yield input, target

    def __len__(self):
        return len(self.loader)


def to_device(loader):
    """A device mover: a generator function around any iterable of batches."""
    for x, y in loader:
        yield x.to(torch.float32), y.to(torch.float32)


def train_one_epoch(epoch, model, loader, opt, iter_log):
    model.train()
    total = 0.0
    for batch_idx, (x, y) in enumerate(loader):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
        print(f"batch {epoch}:{batch_idx} loss {loss.item():.8f}", flush=True)
        if iter_log:
            with open(iter_log, "a") as f:
                f.write(f"{epoch}:{batch_idx}\n")
    return total


def note(line):
    """A line appended to EPOCH_LOG, if set, with os.write (not stdout, not torch.save)."""
    path = os.environ.get("EPOCH_LOG")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def save(epoch, model, opt, path):
    """The script's own checkpoint of each epoch: a temporary file, then os.replace."""
    tmp = path + ".tmp"
    torch.save({"epoch": epoch, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)
    note(f"save {epoch}")


def validate(model, loader):
    note("validate")
    model.eval()
    with torch.no_grad():
        val = sum(F.mse_loss(model(x), y).item() for x, y in loader)
    model.train()
    return val


def main():
    wrapper, epochs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    iter_log = os.environ.get("ITER_LOG")
    torch.manual_seed(0)
    x = torch.randn(288, 8)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(288, 1)
    train_loader = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=16, shuffle=os.environ.get("SHUFFLE", "1") == "1")
    val_loader = DataLoader(TensorDataset(x[256:], y[256:]), batch_size=16)
    if wrapper == "prefetcher":
        loader = Prefetcher(train_loader)
    elif wrapper == "library":
        from wrapped_lib import DeviceLoader

        loader = DeviceLoader(train_loader)
    elif wrapper == "generator":
        loader = None  # a new generator each epoch
    else:
        loader = Prefetcher(train_loader)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    start_epoch = 0

    def run_epoch(epoch):
        if wrapper == "generator":
            epoch_loader = to_device(train_loader)
        elif wrapper == "both":
            epoch_loader = to_device(loader)
        else:
            epoch_loader = loader
        total = train_one_epoch(epoch, model, epoch_loader, opt, iter_log)
        sched.step()
        val = validate(model, val_loader)
        if os.environ.get("EPOCH_LOG"):
            save(epoch, model, opt, out + ".epoch")
        print(f"epoch {epoch} loss {total:.8f} val {val:.8f} lr {sched.get_last_lr()[0]:.6f}",
              flush=True)
        return total, val

    if os.environ.get("EPOCHS") == "list":  # cfrun cannot jump this loop: it replays
        for epoch in list(range(start_epoch, epochs)):
            total, val = run_epoch(epoch)
    else:
        for epoch in range(start_epoch, epochs):
            total, val = run_epoch(epoch)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, out)
    print(f"FINAL loss {total:.8f} val {val:.8f}")


if __name__ == "__main__":
    main()
