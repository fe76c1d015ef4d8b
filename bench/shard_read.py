"""Read speed of one rank's checkpoint shard from the page cache (issue 23, item 5).

Writes a shard of ``--mb`` MB (tensors of 64 MB) with :func:`cfrun.codec.checkpoint.write_shard`
and commits it, then times, each ``--repeats`` times with the file in the page cache:

* ``cat``: ``cat FILE > /dev/null`` (the page cache's speed for a plain sequential read);
* ``load_shard``: :func:`cfrun.codec.checkpoint.load_shard` of the checkout on ``PYTHONPATH``
  (run it with ``PYTHONPATH=/work/main`` for main's, the one-chunk-at-a-time copy).

Usage::

    PYTHONPATH=$PWD .venv/bin/python bench/shard_read.py --mb 1024
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from cfrun.codec import checkpoint as ck
from cfrun.codec.format import encode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shard-read-"))
    try:
        n = max(1, args.mb // 64)
        state = {"t": [torch.randn(16 << 20) for _ in range(n)]}
        tensors: list[torch.Tensor] = []
        tree = encode(state, tensors)
        staging = ck.staging_dir(root, 1)
        entries = ck.write_shard(staging, 0, tree, tensors, {"step": 1})
        step_dir = ck.commit(root, 1, entries, world_size=1, meta={}, keep=None)
        del state, tensors
        path = step_dir / "rank-00000.bin"
        nbytes = path.stat().st_size
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm
        for name in ("cat", "load_shard"):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                if name == "cat":
                    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
                else:
                    got = ck.load_shard(step_dir, 0)
                times.append(time.perf_counter() - t0)
                if name != "cat":
                    del got
            best = min(times)
            print(f"{name:>10}: {nbytes / 1e9:.2f} GB in {best:.3f} s = "
                  f"{nbytes / best / 1e9:.2f} GB/s (best of {args.repeats})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
