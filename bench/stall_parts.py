"""What a checkpoint holds the training thread at its boundary, part by part, for a state of
many tensors: this checkout's cfrun against another's (``--cfrun-root``), side by side.

``bench/_stall_train.py`` (a GPT's layout at a toy width: 294 parameters, ~900 tensors with
AdamW's state, little compute) runs under ``cfrun --launcher python --interval K`` with each
cfrun in turn, alternating over ``--rounds`` (this machine is shared and noisy). From each
run's ``checkpoint`` events: the first checkpoint's stall, the median stall of the others, and
where it went (``capture_s``: the state's capture; ``enqueue_s``: the slot, the copy plan and
the copies' start; a cfrun too old to say has ``-``). Printed: per cfrun the medians over
rounds, and this checkout's over the other's. Issue 23: on a GPU the boundary's host time is
the stall (an H200 GPT with ~900 tensors stalled 16-21 ms per checkpoint, 46 ms the first).

Usage::

    git worktree add /tmp/cfrun-base <commit>
    .venv/bin/python bench/stall_parts.py --cfrun-root /tmp/cfrun-base [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_stall_train.py"


def one_run(root: Path, steps: int, interval: int, tmp: Path) -> dict[str, float | None]:
    """One cfrun run with the cfrun of checkout ``root``; its checkpoints' figures."""
    job = tmp / f"job-{os.getpid()}-{len(list(tmp.iterdir()))}"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "cfrun", "--launcher", "python", "--interval",
                        str(interval), "--job-dir", str(job), str(SCRIPT), str(steps)],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"cfrun of {root} failed:\n{p.stderr[-2000:]}")
    events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]
    ckpts = sorted((e for e in events if e["event"] == "checkpoint"), key=lambda e: e["step"])

    def med(key: str) -> float | None:
        xs = [e[key] for e in ckpts[1:] if e.get(key) is not None]
        return statistics.median(xs) if xs else None
    return {"first_stall_s": ckpts[0]["stall_s"], "stall_s": med("stall_s"),
            "capture_s": med("capture_s"), "enqueue_s": med("enqueue_s"),
            "checkpoints": len(ckpts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cfrun-root", required=True, help="the other checkout (its repo root)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--interval", type=int, default=10)
    a = ap.parse_args()
    roots = {"this": HERE.parent, "other": Path(a.cfrun_root).resolve()}
    runs: dict[str, list[dict[str, float | None]]] = {k: [] for k in roots}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.rounds):
            for name, root in roots.items():
                runs[name].append(one_run(root, a.steps, a.interval, Path(d)))
    keys = ("first_stall_s", "stall_s", "capture_s", "enqueue_s")
    summary = {}
    for name, rs in runs.items():
        print(f"raw {name} ({roots[name]}): " + "; ".join(
            ", ".join(f"{k} {r[k] * 1e3:.2f}" if r[k] is not None else f"{k} -" for k in keys)
            for r in rs))
        summary[name] = {k: statistics.median(r[k] for r in rs) if all(
            r[k] is not None for r in rs) else None for k in keys}
    print(f"\n{'cfrun':8}" + "".join(f"{k + ' ms':>18}" for k in keys))
    for name in roots:
        print(f"{name:8}" + "".join(f"{summary[name][k] * 1e3:>18.2f}" if summary[name][k]
                                    is not None else f"{'-':>18}" for k in keys))
    print(f"{'ratio':8}" + "".join(
        f"{summary['this'][k] / summary['other'][k]:>18.2f}" if summary["this"][k]
        and summary["other"][k] else f"{'-':>18}" for k in keys))


if __name__ == "__main__":
    main()
