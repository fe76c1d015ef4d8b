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

    python bench/step_overhead.py [--rounds 3] [--steps 3000] [--parts]

``--parts`` (issue 33) also runs each loop once more under cfrun with ``cProfile`` enabled in
the rank after the warm-up steps, and prints cfrun's per-step time part by part: the loader's
``next()`` hook, the optimizer step pre-hook (the gate), the post-hook's own work, the
heartbeat, the stop-request check, the policy (``Tuner.on_step`` and ``due``). cProfile
inflates every Python call, so the parts are given as shares of cfrun's profiled time and as
microseconds scaled to the extra measured above.
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


PARTS = {
    "loader next() hook": ("rank/data.py", "rank/loader_epoch.py", "rank/loader_workers.py",
                           "rank/loader_carry.py", "on_loader_next"),
    "step pre-hook (gate)": ("on_before_step", "rank/snapshot.py"),
    "hook wrappers (Guard)": ("rank/install.py", "sitecustomize"),
    "step post-hook (own)": ("on_optimizer_step",),
    "heartbeat": ("beat",),
    "stop-request check": ("stop_due",),
    "policy (tuner)": ("tuner.py",),
}
"""Part -> the cProfile rows (file or function names) it sums; the post-hook's own is its
``tottime``, every other part its functions' ``tottime`` too (so none is counted twice)."""


def _profiled_script(tmp: Path) -> Path:
    """``_step_train.py`` with cProfile enabled from step 200 on, its stats dumped at the end."""
    src = SCRIPT.read_text()
    src = src.replace("import time\n", "import time\nimport cProfile\nPROF = cProfile.Profile()\n", 1)
    src = src.replace("        stamps.append(time.perf_counter())",
                      "        if len(stamps) == 200:\n            PROF.enable()\n"
                      "        stamps.append(time.perf_counter())")
    src = src.replace("stamps.append(time.perf_counter())\ncpu.append(time.thread_time())\nsteps_us",
                      "PROF.disable()\nPROF.dump_stats('rank.prof')\n"
                      "stamps.append(time.perf_counter())\ncpu.append(time.thread_time())\nsteps_us")
    out = tmp / "_step_train_profiled.py"
    out.write_text(src)
    return out


def parts(loader: bool, steps: int, tmp: Path) -> dict[str, float]:
    """cfrun's profiled seconds per step, part by part (see :data:`PARTS`)."""
    import pstats

    script = _profiled_script(tmp)
    job = tmp / "job-prof"
    shutil.rmtree(job, ignore_errors=True)
    argv = [sys.executable, "-m", "cfrun", "--launcher", "python", "--interval", "1000000",
            "--job-dir", str(job), str(script), "--steps", str(steps)] + (
                ["--loader"] if loader else [])
    p = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, timeout=900,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{p.stderr[-2000:]}")
    stats = pstats.Stats(str(tmp / "rank.prof")).stats  # type: ignore[attr-defined]
    counted = steps - 200
    out = dict.fromkeys(PARTS, 0.0)
    for (filename, _, func), (_, _, tottime, _, _) in stats.items():
        if "/cfrun/" not in filename and "sitecustomize" not in filename:
            continue
        for name, keys in PARTS.items():
            if any(k == func or k in filename for k in keys):
                out[name] += tottime / counted
                break
        else:
            out.setdefault("other cfrun code", 0.0)
            out["other cfrun code"] += tottime / counted
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--parts", action="store_true", help="also cfrun's per-step time by part")
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
    if not a.parts:
        return
    with tempfile.TemporaryDirectory() as d:
        for loader in (False, True):
            kind = "loader" if loader else "step"
            extra = statistics.median(c[0] - p[0] for c, p in zip(rows[("cfrun", loader)],
                                                                  rows[("plain", loader)]))
            got = parts(loader, a.steps, Path(d))
            total = sum(got.values()) or 1.0
            print(f"{kind} loop, cfrun's per-step time by part (share of profiled cfrun time; "
                  f"us scaled to the {extra:.1f} us measured):")
            for name, sec in sorted(got.items(), key=lambda kv: -kv[1]):
                print(f"  {name:<24} {100 * sec / total:5.1f}%  {extra * sec / total:6.1f} us")

if __name__ == "__main__":
    main()
