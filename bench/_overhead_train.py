"""Training script timed by ``bench/checkpoint_overhead.py`` (not meant to be run by hand).

A plain PyTorch script that knows nothing about cfrun: an MLP of ~10.5 M parameters
(1024 -> 2048 -> 2048 -> 2048 -> 10, 42 MB of fp32 weights plus 84 MB of Adam ``exp_avg`` and
``exp_avg_sq``, ~126 MB of state) trained with Adam on random batches drawn from a seeded
``torch.Generator``, for ``--steps`` iterations, with ``torch.set_num_threads(2)``.

The checkpointing contender is chosen with ``--contender``:

* ``none``: no checkpoints (the baseline; also what runs under ``cfrun``, which adds its own
  checkpoints through its hooks without any change to this file);
* ``torch_save``: every ``--k`` steps ``torch.save`` of the model and optimizer state dicts
  to a new file in ``--ckpt-dir``, then ``fsync``, synchronously on the training thread;
* ``dcp_thread``: every ``--k`` steps ``torch.distributed.checkpoint.async_save`` with the
  default thread executor (staging copies into fresh memory on the training thread);
* ``dcp_process``: ``async_save`` with ``AsyncCheckpointerType.PROCESS`` and a reused
  ``DefaultStager`` staging into shared memory (pinned memory needs CUDA and is off here);
* ``cfrun``: identical to ``none``; the benchmark driver runs the script under ``cfrun``.

For the DCP contenders a single-rank gloo process group is initialized (the process executor
needs one). Before starting a checkpoint, the previous one is waited for. At most two
checkpoints are kept on disk (older ones are deleted in the checkpoint call, like cfrun's
``--keep 2``).

Timing. The script records ``time.perf_counter()`` at the first line of every iteration's
body and once after the loop; an iteration's time is the difference between consecutive
stamps. That covers data, forward, backward, ``optimizer.step()``, the in-script checkpoint call
and also whatever cfrun does at the head of the loop (its checkpoint boundary) or inside the
step (its snapshot gate). The first ``WARMUP_ITERS`` iterations are not timed.

At exit it prints one line ``RESULT {json}`` with ``ms_per_iter`` (mean over timed
iterations), ``iter_ms`` (all timed iterations), and for in-script contenders
``stall_s`` (seconds the checkpoint call took on the training thread, one per checkpoint)
and ``pgt_s`` (seconds from the start of the checkpoint until it is durable: equal to the
stall for ``torch_save``; for DCP, from the ``async_save`` call until its future completes,
stamped by a done-callback).
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

WARMUP_ITERS = 5
IN_DIM, HIDDEN, CLASSES, BATCH = 1024, 2048, 10, 128
KEEP = 2

parser = argparse.ArgumentParser(description="checkpoint-overhead training script")
parser.add_argument("--contender", default="none",
                    choices=["none", "torch_save", "dcp_thread", "dcp_process", "cfrun",
                             "cfrun_inline"])
parser.add_argument("--k", type=int, default=1, help="checkpoint every k steps")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--ckpt-dir", default=None)
parser.add_argument("--seed", type=int, default=0)


def build_model():
    """The MLP: ~10.5 M parameters."""
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def train_step(model, optimizer, gen):
    """One iteration: draw a batch, forward, backward, Adam step. Returns the loss as a float.

    Kept in a function so the batch and activations are not locals of the training loop
    (cfrun captures the loop's locals; this keeps its checkpoint ~ model + optimizer)."""
    x = torch.randn(BATCH, IN_DIM, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


class Checkpointer:
    """In-script checkpointing for the torch_save / dcp_* contenders."""

    def __init__(self, kind, ckpt_dir, model, optimizer):
        """Prepare ``kind`` (process group, stager) writing under ``ckpt_dir``."""
        self.kind = kind
        self.ckpt_dir = ckpt_dir
        self.model = model
        self.optimizer = optimizer
        self.stall_s = []
        self.pgt_s = []
        self.paths = []
        self.future = None
        self.stager = None
        os.makedirs(ckpt_dir, exist_ok=True)
        if kind.startswith("dcp"):
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp
            self.dist, self.dcp = dist, dcp
            if not dist.is_initialized():
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(_free_port()))
                dist.init_process_group("gloo", rank=0, world_size=1)
            if kind == "dcp_process":
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
                self.process_type = AsyncCheckpointerType.PROCESS
                # pinned memory and non-blocking copies need an accelerator; CPU-only here
                self.stager = DefaultStager(StagingOptions(
                    use_pinned_memory=False, use_shared_memory=True,
                    use_async_staging=False, use_non_blocking_copy=False))

    def _state(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _prune(self):
        """Delete all but the newest ``KEEP`` completed checkpoints."""
        while len(self.paths) > KEEP:
            old = self.paths.pop(0)
            if os.path.isdir(old):
                shutil.rmtree(old, ignore_errors=True)
            elif os.path.exists(old):
                os.remove(old)

    def save(self, step):
        """Checkpoint after ``step``; records the stall (and PGT for torch_save)."""
        t0 = time.perf_counter()
        if self.kind == "torch_save":
            path = os.path.join(self.ckpt_dir, f"step-{step:06d}.pt")
            with open(path, "wb") as f:
                torch.save(self._state(), f)
                f.flush()
                os.fsync(f.fileno())
            self.paths.append(path)
            self._prune()
            dt = time.perf_counter() - t0
            self.stall_s.append(dt)
            self.pgt_s.append(dt)
            return
        self.wait()  # at most one in flight
        self._prune()
        path = os.path.join(self.ckpt_dir, f"step-{step:06d}")
        kwargs = {"checkpoint_id": path}
        if self.kind == "dcp_process":
            kwargs.update(async_checkpointer_type=self.process_type, async_stager=self.stager)
        t_call = time.perf_counter()
        fut = self.dcp.async_save(self._state(), **kwargs)
        if hasattr(fut, "upload_completion"):  # AsyncSaveResponse
            fut = fut.upload_completion
        rec = {"t_call": t_call, "t_done": None}
        fut.add_done_callback(lambda _f, rec=rec: rec.__setitem__("t_done", time.perf_counter()))
        self.future = (fut, rec)
        self.paths.append(path)
        self.stall_s.append(time.perf_counter() - t0)

    def wait(self):
        """Wait for the in-flight DCP checkpoint, if any, and record its PGT."""
        if self.future is None:
            return
        fut, rec = self.future
        self.future = None
        fut.result()
        t_done = rec["t_done"] if rec["t_done"] is not None else time.perf_counter()
        self.pgt_s.append(t_done - rec["t_call"])

    def close(self):
        """Finish the last checkpoint and release DCP resources."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
        if self.kind.startswith("dcp") and self.dist.is_initialized():
            self.dist.destroy_process_group()


def _free_port():
    """A free TCP port on localhost for the single-rank process group."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ckpt = None
    if args.contender in ("torch_save", "dcp_thread", "dcp_process"):
        if not args.ckpt_dir:
            sys.exit("--ckpt-dir is required for " + args.contender)
        ckpt = Checkpointer(args.contender, args.ckpt_dir, model, optimizer)
    stamps = []
    loss = float("nan")
    for step in range(args.steps):
        stamps.append(time.perf_counter())
        loss = train_step(model, optimizer, gen)
        if ckpt is not None and (step + 1) % args.k == 0:
            ckpt.save(step + 1)
    stamps.append(time.perf_counter())
    iter_s = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP_ITERS:]
    if ckpt is not None:
        ckpt.close()
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes += sum(v.numel() * v.element_size() for st in optimizer.state.values()
                       for v in st.values() if torch.is_tensor(v))
    result = {
        "contender": args.contender, "k": args.k, "steps": args.steps,
        "timed_iters": len(iter_s),
        "ms_per_iter": 1e3 * sum(iter_s) / max(1, len(iter_s)),
        "iter_ms": [round(1e3 * s, 3) for s in iter_s],
        "state_bytes": state_bytes, "final_loss": loss,
    }
    if ckpt is not None:
        result["stall_s"] = ckpt.stall_s
        result["pgt_s"] = ckpt.pgt_s
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
