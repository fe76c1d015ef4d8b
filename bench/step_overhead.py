"""What cfrun costs every step when it takes no checkpoint: its optimizer-step hooks, the
DataLoader ``next()`` hook, the heartbeat, the policy's bookkeeping (issue 23: "every step
under cfrun is ~0.6 ms slower in median").

One tiny script (``bench/_step_train.py``: a 32 -> 32 -> 10 MLP, SGD, batches of 8, one
thread; a step costs ~100-200 us, so cfrun's per-step work is not hidden behind compute) is
run plain (``python``) and under ``cfrun --launcher python --interval 1000000`` (no checkpoint
after the first step's setup), as a step loop and as a DataLoader loop, alternating in rounds
on the same machine. Per run: the median time between consecutive loop-body starts after 200
warm-up steps, in wall time and in the training thread's CPU time (``time.thread_time``: the
work the step does, less sensitive to what else this shared machine runs). Printed: per
contender the median over rounds, and cfrun's extra microseconds per step and ratio against
plain from the same round (medians over rounds).

    python bench/step_overhead.py [--rounds 3] [--steps 3000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_step_train.py"


def run(cfrun: bool, loader: bool, steps: int, tmp: Path) -> tuple[float, float]:
    """One run: the median step's wall time and the training thread's CPU time, in
    microseconds."""
    args = [str(SCRIPT), "--steps", str(steps)] + (["--loader"] if loader else [])
    if cfrun:
        job = tmp / "job"
        shutil.rmtree(job, ignore_errors=True)
        argv = [sys.executable, "-m", "cfrun", "--launcher", "python", "--interval", "1000000",
                "--job-dir", str(job), *args]
    else:
        argv = [sys.executable, *args]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, timeout=900,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{p.stderr[-2000:]}")
    doc = json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])
    return statistics.median(doc["step_us"]), statistics.median(doc["cpu_us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3000)
    a = ap.parse_args()
    rows: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.rounds):
            for loader in (False, True):
                for cfrun in (False, True):
                    rows.setdefault(("cfrun" if cfrun else "plain", loader), []).append(
                        run(cfrun, loader, a.steps, Path(d)))
    for (name, loader), got in sorted(rows.items()):
        print(f"raw {'loader' if loader else 'step'} {name}: "
              + ", ".join(f"{w:.0f}/{c:.0f}" for w, c in got) + " (wall/cpu us per round)")
    print(f"{'loop':<7} {'contender':<9} {'wall us/step':>12} {'extra':>7} {'ratio':>6} "
          f"{'cpu us/step':>12} {'extra':>7} {'ratio':>6}")
    for loader in (False, True):
        plain, cf = rows[("plain", loader)], rows[("cfrun", loader)]
        kind = "loader" if loader else "step"
        for name, got in (("plain", plain), ("cfrun", cf)):
            cols = []
            for i in (0, 1):
                med = statistics.median(g[i] for g in got)
                extra = statistics.median(c[i] - p[i] for c, p in zip(got, plain))
                ratio = statistics.median(c[i] / p[i] for c, p in zip(got, plain))
                cols.append(f"{med:>12.1f} {extra:>7.1f} {ratio:>6.3f}" if name == "cfrun"
                            else f"{med:>12.1f} {'':>7} {'':>6}")
            print(f"{kind:<7} {name:<9} {cols[0]} {cols[1]}")

if __name__ == "__main__":
    main()
