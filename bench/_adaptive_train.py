"""Training script run by ``bench/adaptive.py`` (not meant to be run by hand).

A plain PyTorch script that knows nothing about cfrun: an MLP
(1024 -> H -> H -> H -> 10, ``--hidden H``, default 1792: ~8.3 M parameters, 33 MB of fp32
weights plus 66 MB of Adam ``exp_avg`` / ``exp_avg_sq``, ~100 MB of state) trained with Adam on
random batches (``--batch``, default 160) from a seeded ``torch.Generator`` for ``--steps``
iterations, with ``torch.set_num_threads(2)``. The driver runs it bare (the baseline) or under
``cfrun``.

Timing. ``time.perf_counter()`` is stamped at the first line of every iteration's body and once
after the loop; iteration i's time is ``stamp[i + 1] - stamp[i]``, which includes whatever cfrun
does at the loop head (its checkpoint boundary) and inside ``optimizer.step()`` (its gate).
``stamp[i + 1]`` is therefore the moment optimizer step ``i + 1`` (cfrun's step count) and its
boundary were done. A unix-time anchor taken together with a perf_counter reading lets the
driver map wall-clock times (e.g. when it started a disk load) to steps.

``--progress FILE``: the number of iterations begun is rewritten (``pwrite``) into FILE at the
top of each iteration, so the driver can act at a given step while the script runs.

At exit one line ``RESULT {json}``: ``ms_per_iter`` (mean over iterations after the first
``WARMUP_ITERS``), ``iter_ms`` (every iteration), ``stamps_unix_s`` (every stamp, unix time),
``state_bytes`` (parameters + Adam state).
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

WARMUP_ITERS = 5
IN_DIM, CLASSES = 1024, 10

parser = argparse.ArgumentParser(description="adaptive-interval benchmark training script")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--hidden", type=int, default=1792)
parser.add_argument("--batch", type=int, default=160)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--progress", default=None, help="file to pwrite the current step into")


def build_model(hidden):
    """The MLP: three hidden layers of width ``hidden``."""
    return nn.Sequential(
        nn.Linear(IN_DIM, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )


def train_step(model, optimizer, gen, batch):
    """One iteration: draw a batch, forward, backward, Adam step (kept out of the loop's
    locals so that cfrun's checkpoint is ~ model + optimizer)."""
    x = torch.randn(batch, IN_DIM, generator=gen)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def report_progress(fd, step):
    """Rewrite the progress file with ``step`` (a no-op without ``--progress``)."""
    if fd is not None:
        os.pwrite(fd, f"{step:>12}\n".encode(), 0)


def main():
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = build_model(args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    progress_fd = None
    if args.progress:
        progress_fd = os.open(args.progress, os.O_WRONLY | os.O_CREAT, 0o644)
    anchor_unix, anchor_perf = time.time(), time.perf_counter()
    stamps = []
    loss = float("nan")
    for step in range(args.steps):
        stamps.append(time.perf_counter())
        report_progress(progress_fd, step)
        loss = train_step(model, optimizer, gen, args.batch)
    stamps.append(time.perf_counter())
    report_progress(progress_fd, args.steps)
    if progress_fd is not None:
        os.close(progress_fd)
    iter_s = [b - a for a, b in zip(stamps, stamps[1:])]
    timed = iter_s[WARMUP_ITERS:]
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes += sum(v.numel() * v.element_size() for st in optimizer.state.values()
                       for v in st.values() if torch.is_tensor(v))
    result = {
        "steps": args.steps, "hidden": args.hidden, "warmup_iters": WARMUP_ITERS,
        "ms_per_iter": 1e3 * sum(timed) / max(1, len(timed)),
        "iter_ms": [round(1e3 * s, 3) for s in iter_s],
        "stamps_unix_s": [round(anchor_unix + (s - anchor_perf), 6) for s in stamps],
        "state_bytes": state_bytes, "final_loss": loss,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
