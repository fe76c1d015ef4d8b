"""Training script timed by ``bench/recovery.py`` (not meant to be run by hand).

A plain PyTorch script that knows nothing about cfrun: ``bench/_overhead_train.py``'s MLP
(``--hidden`` wide, ~126 MB of model + Adam state at the default 2048) trained with Adam on
seeded random batches for ``--steps`` steps, one thread per rank; with ``WORLD_SIZE`` > 1 (under
torchrun) wrapped in DistributedDataParallel over gloo.

After every optimizer step rank 0 appends ``"<step> <unix time>"`` to ``--stamps`` (opened and
closed in a function, so no file object is a local of the loop), which tells the driver when the
first step after a start or a resume happened.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _overhead_train as ot  # noqa: E402

parser = argparse.ArgumentParser(description="recovery benchmark training script")
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--hidden", type=int, default=2048)
parser.add_argument("--stamps", required=True)
parser.add_argument("--startup-s", type=float, default=0.0,
                    help="sleep this long before building the model (a job's slow start-up: "
                         "CUDA initialisation, a large model's construction)")


def stamp(path, step):
    """Append ``step`` and the time to the stamps file."""
    with open(path, "a") as f:
        f.write(f"{step} {time.time():.6f}\n")


def main():
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ot.HIDDEN = args.hidden
    time.sleep(args.startup_s)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = 0
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    model = ot.build_model()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        ot.train_step(model, optimizer, gen)
        if rank == 0:
            stamp(args.stamps, step + 1)


if __name__ == "__main__":
    main()
