"""What a deterministic failure costs under cfrun against plain torchrun (issue 37, item 5:
"a crash loop costs four times torchrun's time").

Three cases of one small script (``bench/_early_failure_train.py``), each run plain
(``torchrun --standalone --nproc-per-node 1 SCRIPT ARGS``) and under cfrun (``cfrun SCRIPT
ARGS``, its default launcher torchrun, its default policy, a fresh working directory), in
alternating rounds on the same machine:

* ``usage``: an argparse typo (``--stpes 10``): the script fails before its first step;
* ``keyerror``: ``KeyError`` after step ``--fail-at`` (default 2), before the policy's first
  checkpoint (about step 5 here: nothing to resume from, every restart starts over; a later
  step fails after checkpoints, and the crash loop resumes from them);
* ``ok``: the same script run to its end (``--steps --fail-at``), for "one start": what cfrun
  adds to a run that does not fail.

Printed per case: the median wall time of each contender over the rounds, the ratio cfrun /
torchrun, and cfrun's excess over torchrun in units of one start (the ``ok`` case's excess):
the bound of issue 37 is a ratio near 1 with an excess of at most one start.

    python bench/early_failure.py [--rounds 3] [--fail-at 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_early_failure_train.py"


def run_once(cfrun: bool, args: list[str], tmp: Path) -> tuple[float, int]:
    """One run in a fresh working directory: (wall seconds, exit code)."""
    cwd = Path(tempfile.mkdtemp(dir=tmp))
    if cfrun:
        argv = [sys.executable, "-m", "cfrun", str(SCRIPT), *args]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "1", str(SCRIPT), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CFRUN_")}
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    wall_s = time.monotonic() - t0
    shutil.rmtree(cwd, ignore_errors=True)
    return wall_s, p.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fail-at", type=int, default=2)
    opts = parser.parse_args()
    cases = {"usage": ["--stpes", "10"],
             "keyerror": ["--steps", str(opts.fail_at + 20), "--fail-at", str(opts.fail_at)],
             "ok": ["--steps", str(opts.fail_at + 20)]}
    times: dict[tuple[str, bool], list[float]] = {}
    codes: dict[tuple[str, bool], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(opts.rounds):
            for case, args in cases.items():
                for cfrun in (False, True):
                    wall_s, code = run_once(cfrun, args, Path(tmp))
                    times.setdefault((case, cfrun), []).append(wall_s)
                    codes[(case, cfrun)] = code
    med = {k: statistics.median(v) for k, v in times.items()}
    start_s = med[("ok", True)] - med[("ok", False)]
    print(f"{'case':<10} {'torchrun_s':>10} {'cfrun_s':>8} {'ratio':>6} {'excess_s':>8} "
          f"{'excess_starts':>13}  exit codes (torchrun, cfrun)")
    for case in cases:
        plain, ours = med[(case, False)], med[(case, True)]
        # nan where this machine's noise hid the start (a negative or zero excess on "ok")
        starts = (ours - plain) / start_s if start_s > 0 else float("nan")
        print(f"{case:<10} {plain:>10.2f} {ours:>8.2f} {ours / plain:>6.2f} {ours - plain:>8.2f} "
              f"{starts:>13.2f}  {codes[(case, False)]}, {codes[(case, True)]}")
    print(f"one start (cfrun's excess on the run that does not fail): {start_s:.2f} s")


if __name__ == "__main__":
    main()
