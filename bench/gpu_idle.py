"""Where a step's time goes when no checkpoint is due, on a GPU (issue 33: "nothing paid per
step"). The 2026-11-28 H200 run measured ``cfrun_idle`` (``--interval 100000``) at +3.9% of
plain's median step on the 4.43 GB GPT, only after its ~35th step, while ``--interval k*``
showed nothing; this bench splits that, side by side in one run, interleaved over rounds:

* ``plain``: the script alone (``python``);
* ``cfrun_idle``: ``cfrun --interval 100000`` (no checkpoint in the run);
* ``cfrun_idle_noslot``: the same with the snapshot slot never prepared (the fault point
  ``rank.slot_ready_after_steps`` holds its allocation and page-locking back): if this row
  is at plain's speed, the prepared (page-locked) slot is what the idle steps pay for;
* ``cfrun_idle_nolog``: the same with ``CFRUN_CONSOLE_LOG=0`` (the ranks' output not kept).

Prints, per contender, the median step and the medians of the run's four quarters, and the
ratio to plain. Run on a GPU machine from the repository root::

    python bench/gpu_idle.py --steps 150 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from gpu_overhead import IDLE_INTERVAL, TRAIN, run  # noqa: E402

CONTENDERS = ("plain", "cfrun_idle", "cfrun_idle_noslot", "cfrun_idle_nolog")


def one(name: str, work: Path, args: argparse.Namespace) -> list[float]:
    """One run of contender ``name``: its step times in ms (empty on failure, said)."""
    script = [str(TRAIN), "--model", args.model, "--size", args.size, "--steps",
              str(args.steps)]
    env_before = dict(os.environ)
    if name == "plain":
        cmd = [sys.executable, *script, "--contenders", "plain:none:0"]
    else:
        cmd = [sys.executable, "-m", "cfrun", "--interval", str(IDLE_INTERVAL),
               "--max-restarts", "0", "--job-dir", str(work / f"{name}-{os.urandom(3).hex()}"),
               *script]
        if name == "cfrun_idle_noslot":
            os.environ["CFRUN_FAULTS"] = json.dumps({"rank.slot_ready_after_steps": 10**9})
        if name == "cfrun_idle_nolog":
            os.environ["CFRUN_CONSOLE_LOG"] = "0"
    try:
        results, error = run(cmd, work, args.timeout)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    if not results:
        print(f"{name}: no result ({error[-500:]})", flush=True)
        return []
    return list(results[0]["iter_ms"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt")
    p.add_argument("--size", default="full")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    args = p.parse_args()
    names = args.contenders.split(",")
    iters: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="gpu-idle-") as tmp:
        for _ in range(args.rounds):
            for name in names:
                iters[name] += one(name, Path(tmp), args)
    base = statistics.median(iters["plain"]) if iters.get("plain") else None
    print(f"{'contender':<20} {'steps':>5} {'median ms':>9} {'vs plain':>8}  quarters (ms)")
    for name, its in iters.items():
        if not its:
            continue
        med = statistics.median(its)
        n = len(its)
        quarters = [statistics.median(its[i * n // 4:(i + 1) * n // 4]) for i in range(4)]
        ratio = f"{med / base - 1:+.2%}" if base else "-"
        print(f"{name:<20} {n:>5} {med:>9.2f} {ratio:>8}  " +
              " ".join(f"{q:.2f}" for q in quarters), flush=True)


if __name__ == "__main__":
    main()
