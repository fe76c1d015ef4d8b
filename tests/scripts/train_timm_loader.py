"""timm's data pipeline with its defaults, in miniature (issue 34, item 2), unmodified by cfrun.

``create_loader()`` builds the DataLoader as timm's ``timm/data/loader.py`` does: 2 workers,
``persistent_workers=True``, a ``worker_init_fn`` that seeds python/numpy/torch from
``get_worker_info().seed`` (timm's ``_worker_init`` with ``worker_seeding='all'``), ``drop_last``
for training, the loader read through timm's ``PrefetchLoader`` (``timm_lib``: one batch ahead, a
library's class). The training set augments every sample with draws from torch, numpy and
python's ``random`` in the workers; the eval set does not (its loader has persistent workers
too, as timm's). The training loop mixes batches (``Mixup``: numpy and torch global RNG in the
main process), accumulates gradients over ``--accum`` batches, validates after each epoch and
keeps the best metric in a variable, as timm's ``train.py`` does.

``train_timm_loader.py --out FINAL [--epochs N]``: prints one line per batch and per
validation, saves model, optimizer and ``best_metric`` to FINAL. Beyond timm's defaults:
``--eval-augment`` augments the eval set too (test-time augmentation: the eval workers' random
streams matter), ``--eval-generator`` shuffles it with a ``generator=`` of its own, and
``--validate-first`` validates once before the epoch loop (the eval workers already run when a
resumed run reaches its checkpoint).
"""

import argparse
import random
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm_lib import PrefetchLoader
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    """Tiny "images" (16 features) with a per-sample random augmentation when ``train``."""

    def __init__(self, n, augment, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :4].sum(1) > 0).long()
        self.augment = augment

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if self.augment:
            if random.random() < 0.5:  # python: a "flip"
                x = x.flip(0)
            x = x * float(np.random.uniform(0.8, 1.2))  # numpy: a "color jitter"
            x = x + 0.2 * torch.randn(16)  # torch: noise
        return x, self.y[i]


def _worker_init(worker_id, worker_seeding="all"):
    """timm.data.loader._worker_init."""
    worker_info = torch.utils.data.get_worker_info()
    assert worker_info.id == worker_id
    if worker_seeding == "all":
        seed = worker_info.seed
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(seed % (2 ** 32 - 1))


def create_loader(dataset, batch_size, is_training, num_workers=2, persistent_workers=True,
                  shuffle=None, generator=None):
    """timm.data.loader.create_loader's DataLoader and PrefetchLoader, with its defaults."""
    loader = DataLoader(dataset, batch_size=batch_size,
                        shuffle=is_training if shuffle is None else shuffle,
                        num_workers=num_workers, drop_last=is_training,
                        worker_init_fn=partial(_worker_init, worker_seeding="all"),
                        persistent_workers=persistent_workers, generator=generator)
    return PrefetchLoader(loader)


class Mixup:
    """timm's Mixup in brief: ``lam`` from numpy's global RNG, the partner order from torch's."""

    def __init__(self, alpha=0.4, prob=0.8):
        self.alpha = alpha
        self.prob = prob

    def __call__(self, x, target):
        lam = 1.0
        if np.random.rand() < self.prob:
            lam = float(np.random.beta(self.alpha, self.alpha))
        perm = torch.randperm(x.size(0))
        x = x * lam + x[perm] * (1.0 - lam)
        y = F.one_hot(target, 2).float()
        return x, y * lam + y[perm] * (1.0 - lam)


def train_one_epoch(epoch, model, loader, optimizer, mixup, args):
    model.train()
    last_idx = len(loader) - 1
    total = 0.0
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_idx
        need_update = last_batch or (batch_idx + 1) % args.accum == 0
        input, target = mixup(input, target)
        loss = torch.sum(-target * F.log_softmax(model(input), dim=-1), dim=-1).mean()
        (loss / args.accum).backward()
        if need_update:
            optimizer.step()
            optimizer.zero_grad()
        total += loss.item()
        print(f"train {epoch} {batch_idx} {loss.item():.10f}", flush=True)
    return total / (last_idx + 1)


def validate(epoch, model, loader):
    model.eval()
    correct = 0
    n = 0
    loss = 0.0
    with torch.no_grad():
        for input, target in loader:
            out = model(input)
            loss += F.cross_entropy(out, target, reduction="sum").item()
            correct += int((out.argmax(1) == target).sum())
            n += input.size(0)
    print(f"eval {epoch} loss {loss / n:.10f} acc {correct / n:.4f}", flush=True)
    return loss / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--eval-augment", action="store_true")
    p.add_argument("--eval-generator", action="store_true")
    p.add_argument("--validate-first", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(42)
    np.random.seed(42)
    random.seed(42)
    torch.set_num_threads(1)
    loader_train = create_loader(Images(96, True, 1), 16, is_training=True)
    eval_gen = torch.Generator().manual_seed(3) if args.eval_generator else None
    loader_eval = create_loader(Images(32, args.eval_augment, 2), 16, is_training=False,
                                shuffle=args.eval_generator, generator=eval_gen)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mixup = Mixup()
    best_metric = None
    best_epoch = None
    if args.validate_first:
        validate(-1, model, loader_eval)
    for epoch in range(args.epochs):
        train_one_epoch(epoch, model, loader_train, optimizer, mixup, args)
        metric = validate(epoch, model, loader_eval)
        if best_metric is None or metric < best_metric:
            best_metric, best_epoch = metric, epoch
    print(f"best {best_metric:.10f} epoch {best_epoch}", flush=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "best_metric": best_metric, "best_epoch": best_epoch}, args.out)


if __name__ == "__main__":
    main()
