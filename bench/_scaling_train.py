"""Training script timed by ``bench/scaling.py`` (not meant to be run by hand).

A plain PyTorch script that knows nothing about cfrun: one embedding table of ``--rows`` x
``--dim`` fp32 (a recommendation model's shape: large state, cheap step) summed into a small
linear head, trained with dense Adam on random batches of ``--batch`` indices drawn from a
seeded ``torch.Generator``, for ``--steps`` iterations, with ``torch.set_num_threads(1)``. The
state is the table and head plus Adam's ``exp_avg`` and ``exp_avg_sq``: ~12 bytes per
parameter, so ``--rows`` sets it (``scaling.rows_for``). Every step touches the whole state
(the dense gradient of the table and Adam's update), so the step costs about three passes over
the state's memory and no compute to speak of.

``--contender`` is one of ``bench/_overhead_train.py``'s (its :class:`Checkpointer` is reused:
``torch_save``, ``dcp_thread``, ``dcp_process`` checkpoint in the script; ``none`` and ``cfrun``
do not, the driver runs the latter under ``cfrun``).

Timing as ``_overhead_train.py``: a stamp at the first line of every iteration's body, the
first ``WARMUP_ITERS`` iterations not timed. At exit one line ``RESULT {json}`` with
``ms_per_iter``, ``iter_ms``, ``state_bytes``, ``stall_s``/``pgt_s`` (in-script contenders) and
``max_rss_bytes`` (the peak resident memory of this process, ``ru_maxrss``, and of its reaped
children, which for ``dcp_process`` is DCP's writer process).

``--load``: instead of training, time a resume's load of the newest checkpoint the contender
wrote under ``--ckpt-dir`` (``cfrun``: the job dir, through cfrun's own
``load_newest``), after dropping its files from the page cache (``posix_fadvise DONTNEED``:
what a restarted node would read from the disk). Prints ``RESULT {"load_s": ...}``.
"""

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _overhead_train import Checkpointer  # noqa: E402

WARMUP_ITERS = 3

parser = argparse.ArgumentParser(description="scaling benchmark training script")
parser.add_argument("--contender", default="none",
                    choices=["none", "torch_save", "dcp_thread", "dcp_process", "cfrun"])
parser.add_argument("--k", type=int, default=5, help="checkpoint every k steps")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--rows", type=int, default=65536)
parser.add_argument("--dim", type=int, default=128)
parser.add_argument("--batch", type=int, default=4096)
parser.add_argument("--ckpt-dir", default=None)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--load", action="store_true", help="time the load of the newest checkpoint")


class EmbeddingModel(nn.Module):
    """An embedding table and a linear head: ``rows * dim + dim + 1`` parameters."""

    def __init__(self, rows, dim):
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, idx):
        return self.head(self.table(idx).sum(dim=1))


def build(rows, dim):
    """Model and Adam, with Adam's state allocated (one step with zero gradients)."""
    model = EmbeddingModel(rows, dim)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer


def train_step(model, optimizer, gen, rows, batch):
    """One iteration: 8 indices per sample, a regression on random targets, Adam (dense)."""
    idx = torch.randint(0, rows, (batch, 8), generator=gen)
    y = torch.randn(batch, 1, generator=gen)
    loss = (model(idx) - y).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def state_bytes_of(model, optimizer):
    """Bytes of parameters + Adam state tensors."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(v.numel() * v.element_size() for st in optimizer.state.values()
             for v in st.values() if torch.is_tensor(v))
    return n


def max_rss_bytes():
    """Peak resident bytes of this process and (separately) of its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return own, kids


def drop_cache(root):
    """Drop every file under ``root`` from the page cache (clean pages only: they were
    fsynced); returns the bytes of the files."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                total += os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return total


def newest(paths):
    return sorted(paths)[-1] if paths else None


def load(args):
    """Time the load of the newest checkpoint of ``args.contender`` in ``args.ckpt_dir``."""
    root = Path(args.ckpt_dir)
    out = {"contender": args.contender}
    if args.contender == "cfrun":
        from cfrun.codec.checkpoint import check_usable, load_shard
        from cfrun.contract.checkpoints import committed_steps
        from cfrun.contract.jobdir import JobDir, step_dir_name

        ckpts = JobDir(root).checkpoints
        step = committed_steps(ckpts)[0]
        step_dir = ckpts / step_dir_name(step)
        out["files_bytes"] = drop_cache(step_dir)
        t0 = time.perf_counter()
        check_usable(step_dir, world_size=1)
        t1 = time.perf_counter()
        state, _meta = load_shard(step_dir, 0)
        t2 = time.perf_counter()
        out.update(load_s=t2 - t0, verify_s=t1 - t0, read_decode_s=t2 - t1, step=step)
        del state
    elif args.contender == "torch_save":
        path = newest([str(p) for p in root.glob("step-*.pt")])
        out["files_bytes"] = drop_cache(root)
        t0 = time.perf_counter()
        state = torch.load(path, weights_only=True)
        out["load_s"] = time.perf_counter() - t0
        del state
    else:  # dcp_*: load in place into a live model + optimizer, as a DCP resume does
        import torch.distributed.checkpoint as dcp

        path = newest([str(p) for p in root.glob("step-*") if p.is_dir()])
        model, optimizer = build(args.rows, args.dim)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        out["files_bytes"] = drop_cache(path)
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=path)
        out["load_s"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(out), flush=True)


def main():
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.load:
        load(args)
        return
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model, optimizer = build(args.rows, args.dim)
    ckpt = None
    if args.contender in ("torch_save", "dcp_thread", "dcp_process"):
        if not args.ckpt_dir:
            sys.exit("--ckpt-dir is required for " + args.contender)
        ckpt = Checkpointer(args.contender, args.ckpt_dir, model, optimizer)
    stamps = []
    loss = float("nan")
    for step in range(args.steps):
        stamps.append(time.perf_counter())
        loss = train_step(model, optimizer, gen, args.rows, args.batch)
        if ckpt is not None and (step + 1) % args.k == 0:
            ckpt.save(step + 1)
    stamps.append(time.perf_counter())
    iter_s = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP_ITERS:]
    if ckpt is not None:
        ckpt.close()
    own, kids = max_rss_bytes()
    result = {
        "contender": args.contender, "k": args.k, "steps": args.steps,
        "ms_per_iter": 1e3 * sum(iter_s) / max(1, len(iter_s)),
        "iter_ms": [round(1e3 * s, 3) for s in iter_s],
        "state_bytes": state_bytes_of(model, optimizer), "final_loss": loss,
        "max_rss_bytes": own, "children_max_rss_bytes": kids,
    }
    if ckpt is not None:
        result["stall_s"] = ckpt.stall_s
        result["pgt_s"] = ckpt.pgt_s
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
