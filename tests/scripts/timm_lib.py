"""The parts of timm that ``train_timm.py`` uses, reduced from ``timm/data/loader.py``
(``PrefetchLoader``), ``timm/utils/checkpoint_saver.py`` (``CheckpointSaver``),
``timm/scheduler/cosine_lr.py`` and ``timm/utils/summary.py``: a library module of its own, as
timm is (cfrun sees the script's frames; these are a library's)."""

import csv
import math
import os
from contextlib import suppress

import torch


class PrefetchLoader:
    """timm's PrefetchLoader: normalizes on the device one batch ahead of the consumer; an
    empty loader raises UnboundLocalError at the last ``yield``."""

    def __init__(self, loader, mean=(0.5,), std=(0.25,), device=None):
        self.loader = loader
        self.device = device = device if device is not None else torch.device("cpu")
        self.mean = torch.tensor(mean, device=device).view(1, -1)
        self.std = torch.tensor(std, device=device).view(1, -1)
        self.is_cuda = device.type == "cuda"

    def __iter__(self):
        first = True
        if self.is_cuda:
            stream = torch.cuda.Stream(device=self.device)
            stream_context = lambda: torch.cuda.stream(stream)  # noqa: E731
        else:
            stream = None
            stream_context = suppress

        for next_input, next_target in self.loader:
            with stream_context():
                next_input = next_input.to(device=self.device, non_blocking=True)
                next_target = next_target.to(device=self.device, non_blocking=True)
                next_input = next_input.sub(self.mean).div(self.std)

            if not first:
                yield input, target  # noqa: F821, F823 (bound after the first pass)
            else:
                first = False

            if stream is not None:
                torch.cuda.current_stream(device=self.device).wait_stream(stream)

            input = next_input
            target = next_target

        yield input, target

    def __len__(self):
        return len(self.loader)

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def dataset(self):
        return self.loader.dataset


class CheckpointSaver:
    """timm's CheckpointSaver: ``last.pth.tar`` written as ``tmp.pth.tar`` then
    ``os.replace``; the best ``max_history`` epochs kept as ``checkpoint-N.pth.tar``, the best
    as ``model_best.pth.tar``."""

    def __init__(self, model, optimizer, args=None, checkpoint_dir="", decreasing=False,
                 max_history=10):
        self.model = model
        self.optimizer = optimizer
        self.args = args
        self.checkpoint_files = []  # (filename, metric) tuples in order of decreasing betterness
        self.best_epoch = None
        self.best_metric = None
        self.checkpoint_dir = checkpoint_dir
        self.save_prefix = "checkpoint"
        self.extension = ".pth.tar"
        self.decreasing = decreasing
        self.cmp = (lambda x, y: x < y) if decreasing else (lambda x, y: x > y)
        self.max_history = max_history

    def _replace(self, src, dst):
        os.replace(src, dst)

    def _duplicate(self, src, dst):
        if os.path.exists(dst):
            os.unlink(dst)
        os.link(src, dst)

    def save_checkpoint(self, epoch, metric=None):
        assert epoch >= 0
        tmp_save_path = os.path.join(self.checkpoint_dir, "tmp" + self.extension)
        last_save_path = os.path.join(self.checkpoint_dir, "last" + self.extension)
        self._save(tmp_save_path, epoch, metric)
        self._replace(tmp_save_path, last_save_path)

        worst_file = self.checkpoint_files[-1] if self.checkpoint_files else None
        if (len(self.checkpoint_files) < self.max_history
                or metric is None or self.cmp(metric, worst_file[1])):
            if len(self.checkpoint_files) >= self.max_history:
                self._cleanup_checkpoints(1)
            filename = "-".join([self.save_prefix, str(epoch)]) + self.extension
            save_path = os.path.join(self.checkpoint_dir, filename)
            self._duplicate(last_save_path, save_path)
            self.checkpoint_files.append((save_path, metric))
            self.checkpoint_files = sorted(self.checkpoint_files, key=lambda x: x[1],
                                           reverse=not self.decreasing)
            if metric is not None and (self.best_metric is None
                                       or self.cmp(metric, self.best_metric)):
                self.best_epoch = epoch
                self.best_metric = metric
                best_save_path = os.path.join(self.checkpoint_dir, "model_best" + self.extension)
                self._duplicate(last_save_path, best_save_path)
        return (None, None) if self.best_metric is None else (self.best_metric, self.best_epoch)

    def _save(self, save_path, epoch, metric=None):
        save_state = {"epoch": epoch, "arch": type(self.model).__name__,
                      "state_dict": self.model.state_dict(),
                      "optimizer": self.optimizer.state_dict(), "version": 2}
        if metric is not None:
            save_state["metric"] = metric
        torch.save(save_state, save_path)

    def _cleanup_checkpoints(self, trim=0):
        trim = min(len(self.checkpoint_files), trim)
        delete_index = self.max_history - trim
        if delete_index < 0 or len(self.checkpoint_files) <= delete_index:
            return
        for d in self.checkpoint_files[delete_index:]:
            os.remove(d[0])
        self.checkpoint_files = self.checkpoint_files[:delete_index]


class CosineLRScheduler:
    """timm's cosine schedule per update (``step_update``), no state of its own beyond the
    optimizer's learning rates."""

    def __init__(self, optimizer, t_initial, lr_min=0.0):
        self.optimizer = optimizer
        self.t_initial = t_initial
        self.lr_min = lr_min
        self.base_values = [g["lr"] for g in optimizer.param_groups]

    def _get_lr(self, t):
        return [self.lr_min + 0.5 * (lr - self.lr_min) * (1 + math.cos(math.pi * t / self.t_initial))
                for lr in self.base_values]

    def step(self, epoch, metric=None):
        pass  # t_in_epochs=False: the schedule moves per update

    def step_update(self, num_updates, metric=None):
        for group, lr in zip(self.optimizer.param_groups, self._get_lr(num_updates)):
            group["lr"] = lr


def update_summary(epoch, train_metrics, eval_metrics, filename, lr=None, write_header=False):
    """timm's summary.csv: one row per epoch, appended."""
    rowd = {"epoch": epoch}
    rowd.update([("train_" + k, v) for k, v in train_metrics.items()])
    rowd.update([("eval_" + k, v) for k, v in eval_metrics.items()])
    if lr is not None:
        rowd["lr"] = lr
    with open(filename, mode="a") as cf:
        dw = csv.DictWriter(cf, fieldnames=rowd.keys())
        if write_header:
            dw.writeheader()
        dw.writerow(rowd)
