"""A reduction of timm's ``train.py``, unmodified by cfrun: the training loader behind timm's
``PrefetchLoader`` (from ``timm_lib``, a module of its own as timm is), ``for epoch in
range(start_epoch, num_epochs)`` calling ``train_one_epoch()``, then ``validate()``, then
``saver.save_checkpoint()`` (``tmp.pth.tar`` then ``os.replace``) and ``update_summary()``.

``train_timm.py --output DIR --epochs N --out FINAL``. ``validate()`` and each save append a
line to ``DIR/epoch_ends.log`` with ``os.open``/``os.write`` (not stdout, not ``torch.save``):
the count of epoch-end runs, whatever cfrun suppresses.
"""

import argparse
import os
from collections import OrderedDict

import torch
import torch.nn as nn
from timm_lib import CheckpointSaver, CosineLRScheduler, PrefetchLoader, update_summary
from torch.utils.data import DataLoader, TensorDataset


class AverageMeter:
    def __init__(self):
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def note(args, line):
    """One line appended to the epoch-end log: counts the run, even if output is suppressed."""
    fd = os.open(os.path.join(args.output, "epoch_ends.log"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, lr_scheduler=None):
    losses_m = AverageMeter()
    model.train()
    last_idx = len(loader) - 1
    num_updates = epoch * len(loader)
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_idx
        output = model(input)
        loss = loss_fn(output, target)
        losses_m.update(loss.item(), input.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        num_updates += 1
        if last_batch or batch_idx % args.log_interval == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"Train: {epoch} [{batch_idx:>4d}/{len(loader)}] Loss: {losses_m.val:#.8g} "
                  f"({losses_m.avg:#.6g}) LR: {lr:.6e}", flush=True)
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
    return OrderedDict([("loss", losses_m.avg)])


def validate(model, loader, loss_fn, args):
    note(args, "validate")
    losses_m = AverageMeter()
    model.eval()
    with torch.no_grad():
        for batch_idx, (input, target) in enumerate(loader):
            output = model(input)
            loss = loss_fn(output, target)
            losses_m.update(loss.item(), input.size(0))
    print(f"Test: Loss: {losses_m.avg:#.8g}", flush=True)
    return OrderedDict([("loss", losses_m.avg)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log-interval", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    os.makedirs(args.output, exist_ok=True)
    torch.manual_seed(args.seed)

    x = torch.randn(320, 8)
    y = (x[:, :4].sum(1) > 0).long()
    loader_train = PrefetchLoader(DataLoader(TensorDataset(x[:256], y[:256]), batch_size=16,
                                             shuffle=True, drop_last=True))
    loader_eval = PrefetchLoader(DataLoader(TensorDataset(x[256:], y[256:]), batch_size=32))

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    num_epochs = args.epochs
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=num_epochs * len(loader_train))
    train_loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    validate_loss_fn = nn.CrossEntropyLoss()

    eval_metric = "loss"
    best_metric = None
    best_epoch = None
    saver = CheckpointSaver(model=model, optimizer=optimizer, args=args,
                            checkpoint_dir=args.output, decreasing=True, max_history=2)
    start_epoch = 0
    try:
        for epoch in range(start_epoch, num_epochs):
            if hasattr(loader_train.sampler, "set_epoch"):
                loader_train.sampler.set_epoch(epoch)
            train_metrics = train_one_epoch(epoch, model, loader_train, optimizer,
                                            train_loss_fn, args, lr_scheduler=lr_scheduler)
            eval_metrics = validate(model, loader_eval, validate_loss_fn, args)
            lrs = [g["lr"] for g in optimizer.param_groups]
            update_summary(epoch, train_metrics, eval_metrics,
                           filename=os.path.join(args.output, "summary.csv"),
                           lr=sum(lrs) / len(lrs), write_header=best_metric is None)
            if saver is not None:
                save_metric = eval_metrics[eval_metric]
                best_metric, best_epoch = saver.save_checkpoint(epoch, metric=save_metric)
                note(args, f"save {epoch}")
            if lr_scheduler is not None:
                lr_scheduler.step(epoch + 1, eval_metrics[eval_metric])
    except KeyboardInterrupt:
        pass
    if best_metric is not None:
        print(f"*** Best metric: {best_metric} (epoch {best_epoch})")
    torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, args.out)
    print(f"FINAL best {best_metric} epoch {best_epoch}")


if __name__ == "__main__":
    main()
