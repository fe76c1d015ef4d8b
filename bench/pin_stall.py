"""What preparing the snapshot slot costs the training thread, and whether a copy across two
page-locked pieces stays asynchronous (issue 23, one GPU).

On an H200 a fixed-interval run of the 4.4 GB GPT lost 1.5 s in one step right after start-up:
the slot was being page-locked by one ``cudaHostRegister`` of the whole, not yet faulted-in
mapping on the preparing thread, and the training thread's CUDA calls waited. Contenders, in
this one process, one after another on the same "training" loop (a chain of bf16 matrix
products of about ``--step-ms`` on the GPU, then ``.item()``), each while a slot of ``--gb``
is prepared on a background thread:

* ``none``: nothing in the background (the baseline);
* ``one_call``: the old way: a fresh mapping page-locked by one ``cudaHostRegister`` through
  ``torch.cuda.cudart()``, then written once;
* ``cfrun``: :meth:`cfrun.rank.slot.SnapshotSlot.prepare` as it is now (written first,
  then page-locked in pieces of :data:`cfrun.rank.cuda.PIN_CHUNK_BYTES`, pausing between).

Per contender: the steps' median and largest time (ms), the sum of what the steps took over
the baseline median (ms), and how long the preparation took (s). Then ``span``: the host time
of a ``copy_(non_blocking=True)`` from the GPU into a page-locked host range queued behind a
~200 ms kernel, inside one registered piece and across two: an asynchronous copy returns at
once, one the driver treats as pageable blocks until the kernel is done.

Usage (one GPU; prints one JSON line per contender and ``RESULT`` with all)::

    python bench/pin_stall.py --gb 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cfrun.rank import slot as S  # noqa: E402


def steps_while(background, n_steps: int, a: torch.Tensor, reps: int) -> tuple[list[float],
                                                                                  float]:
    """Run ``n_steps`` steps on the main thread while ``background()`` runs on another; the
    step times (s) and the background's duration (s)."""
    took = [0.0]

    def bg():
        t0 = time.perf_counter()
        background()
        took[0] = time.perf_counter() - t0

    th = threading.Thread(target=bg)
    times = []
    th.start()
    for _ in range(n_steps):
        t0 = time.perf_counter()
        x = a
        for _ in range(reps):
            x = x @ a
        float(x[0, 0].float().item())
        times.append(time.perf_counter() - t0)
    th.join()
    return times, took[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--shm", default="/dev/shm")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) / 64
    for _ in range(3):
        (a @ a).sum().item()
    t0 = time.perf_counter()
    x = a
    for _ in range(10):
        x = x @ a
    x.sum().item()
    per_mm = (time.perf_counter() - t0) / 10
    reps = max(1, int(0.02 / per_mm))  # ~20 ms steps
    results = {}

    def none():
        time.sleep(0.5)

    def one_call():
        path = Path(tempfile.mkstemp(dir=args.shm)[1])
        try:
            with open(path, "r+b") as f:
                f.truncate(nbytes)
            buf = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1)
            buf.fill_(0)
            if int(rc) == 0:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            del buf
        finally:
            path.unlink()

    def cfrun_prepare():
        job = Path(tempfile.mkdtemp(dir=args.shm))
        job.chmod(0o700)
        slot = S.SnapshotSlot(job, 0)
        slot.prepare(nbytes, pin=True, device=dev)
        slot.wait_prepared()
        results["cfrun_pinned"] = slot.pinned, slot.pin_error
        slot.release()

    base = None
    for name, fn in (("none", none), ("one_call", one_call), ("cfrun", cfrun_prepare)):
        try:
            times, bg_s = steps_while(fn, args.steps, a, reps)
        except Exception as e:  # keep the other contenders' figures
            results[name] = {"name": name, "error": repr(e)}
            print(json.dumps(results[name]), flush=True)
            continue
        med = statistics.median(times)
        base = base or med
        row = {"name": name, "median_ms": 1e3 * med, "max_ms": 1e3 * max(times),
               "over_baseline_ms": 1e3 * sum(max(0.0, t - base) for t in times),
               "prepare_s": bg_s}
        results[name] = row
        print(json.dumps(row), flush=True)

    try:
        results["span"] = span_check(a, per_mm, args.shm, dev)
    except Exception as e:
        results["span"] = {"error": repr(e)}
    print(json.dumps(results["span"]), flush=True)
    print("RESULT " + json.dumps(results), flush=True)
    return 0


def span_check(a: torch.Tensor, per_mm: float, shm: str, dev: torch.device) -> dict:
    """Host time of a GPU-to-host copy queued behind ~200 ms of work: into torch's pinned
    memory, inside one registered piece of a /dev/shm mapping, and across two pieces."""
    piece = 64 << 20
    host = torch.empty(2 * piece, dtype=torch.uint8).pin_memory()  # torch's own: one range
    path = Path(tempfile.mkstemp(dir=shm)[1])
    with open(path, "r+b") as f:
        f.truncate(2 * piece)
    mapped = torch.from_file(str(path), shared=True, size=2 * piece, dtype=torch.uint8)
    mapped.fill_(0)
    rcs = [int(torch.cuda.cudart().cudaHostRegister(mapped.data_ptr() + i * piece, piece, 1))
           for i in range(2)]
    src = torch.ones(2 * piece, dtype=torch.uint8, device=dev)
    span = {"register_rc": rcs}
    for label, dst, lo, hi in (("one_range", host, piece // 2, piece // 2 + piece),
                               ("within_piece", mapped, 0, piece),
                               ("across_pieces", mapped, piece // 2, piece // 2 + piece)):
        torch.cuda.synchronize()
        y = a
        for _ in range(int(0.2 / per_mm)):  # ~200 ms of queued work
            y = y @ a
        t0 = time.perf_counter()
        dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
        span[label + "_host_ms"] = 1e3 * (time.perf_counter() - t0)
        torch.cuda.synchronize()
        span[label + "_exact"] = bool((dst[lo:hi] == 1).all())
        dst.zero_()
    for i in range(2):
        torch.cuda.cudart().cudaHostUnregister(mapped.data_ptr() + i * piece)
    path.unlink()
    return span


if __name__ == "__main__":
    sys.exit(main())
