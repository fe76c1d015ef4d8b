"""What a checkpoint costs a GPU-shaped step, on a CPU (issue 33): per-checkpoint cost in steps,
part by part, and what cfrun costs a step with no checkpoint due.

The unmodified script ``bench/_gpu_shaped_train.py`` does a GPU step's host work (hundreds of
small launches, a GIL-free wait for the "device", ``loss.item()``, the optimizer step) over a
state of ``--state-mb`` megabytes. Contenders, one after another on the same work:

* ``plain`` (``python``, the baseline) and, last, ``plain_after`` (the machine's drift);
* ``cfrun_idle``: ``cfrun --interval 1000000000`` (hooks, agent, prepared slot, no checkpoint);
* ``cfrun_policy``: ``cfrun --overhead 3.5%``; its persists give ``k* = ceil(pgt / step)``,
  the least interval at which one checkpoint's persist ends before the next is due;
* ``cfrun_k``, ``cfrun_2k``: ``cfrun --interval`` k*, 2k*.

Per row: mean step (ms), overhead against the plain runs' mean, checkpoints, and the
**per-checkpoint cost** in steps (DESIGN §10): the excess step time a checkpoint causes from
its boundary to the next one, split into ``boundary`` (the iteration whose optimizer step took
the checkpoint: the stall), ``next`` (the following one: the gate) and ``persist`` (the
iterations while the persist ran), medians over the checkpoints after the first, and ``total``
(the run's whole excess over the plain mean divided by its checkpoints). Raw JSON goes to
``bench/results/gpu_shaped.json``.

    .venv/bin/python bench/gpu_shaped.py [--steps 300] [--state-mb 256] [--device-ms 60]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "_gpu_shaped_train.py"
WARMUP_ITERS = 20
IDLE_INTERVAL = 1_000_000_000


def _run(cmd: list[str], cwd: Path, timeout_s: float) -> dict | None:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  {cmd[3:6]} failed ({p.returncode}): {p.stderr[-400:]}", file=sys.stderr)
    return None


def _events(job: Path) -> list[dict]:
    path = job / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []


def contender(name: str, cfrun_args: list[str] | None, script_args: list[str], work: Path,
              timeout_s: float) -> dict:
    job = work / name
    if cfrun_args is None:
        cmd = [sys.executable, str(TRAIN), *script_args]
    else:
        cmd = [sys.executable, "-m", "cfrun", "--launcher", "python", *cfrun_args,
               "--max-restarts", "0", "--job-dir", str(job), str(TRAIN), *script_args]
    result = _run(cmd, work, timeout_s) or {"iter_ms": [], "state_bytes": 0}
    evs = _events(job) if cfrun_args is not None else []
    return {"name": name, "iter_ms": result["iter_ms"], "state_bytes": result["state_bytes"],
            "checkpoints": sorted((e for e in evs if e["event"] == "checkpoint"),
                                  key=lambda e: e["step"]),
            "deferred": sum(e["event"] == "checkpoint_deferred" for e in evs)}


def per_checkpoint(row: dict, base_ms: float) -> dict:
    """The row's per-checkpoint cost in steps, total and part by part (see the module doc)."""
    it, ckpts = row["iter_ms"], row["checkpoints"]
    out: dict = {"mean_ms": statistics.mean(it) if it else None,
                 "overhead": statistics.mean(it) / base_ms - 1 if it else None,
                 "checkpoints": len(ckpts), "deferred": row.get("deferred", 0)}
    if not it or not ckpts:
        return out
    counted = [c for c in ckpts if c["step"] - 1 - WARMUP_ITERS >= 0]
    parts: dict[str, list[float]] = {"boundary": [], "next": [], "persist": []}
    for c in counted[1:] or counted:
        i = c["step"] - 1 - WARMUP_ITERS  # the iteration whose optimizer step took it
        span = max(1, math.ceil(float(c.get("pgt_s") or 0) * 1e3 / base_ms))
        if i + 1 >= len(it):
            continue
        parts["boundary"].append((it[i] - base_ms) / base_ms)
        parts["next"].append((it[i + 1] - base_ms) / base_ms)
        parts["persist"].append(sum(x - base_ms for x in it[i + 2:i + 1 + span]) / base_ms)
    out.update({k: statistics.median(v) if v else None for k, v in parts.items()})
    inside = [c for c in ckpts if WARMUP_ITERS < c["step"] <= WARMUP_ITERS + len(it)]
    out["total"] = (sum(it) - len(it) * base_ms) / base_ms / max(1, len(inside))
    out["stall_ms"] = statistics.median(c["stall_s"] for c in ckpts) * 1e3
    out["pgt_s"] = statistics.median(float(c.get("pgt_s") or 0) for c in ckpts)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policy-steps", type=int, default=300,
                    help="extra iterations of the --overhead run (its profile takes ~50)")
    ap.add_argument("--state-mb", type=float, default=256.0)
    ap.add_argument("--device-ms", type=float, default=60.0)
    ap.add_argument("--launches", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--rounds", type=int, default=1, help="the whole sequence, this many times")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gpu_shaped.json")
    args = ap.parse_args(argv)
    script = ["--state-mb", str(args.state_mb), "--device-ms", str(args.device_ms),
              "--launches", str(args.launches)]
    steps = ["--steps", str(args.steps)]
    rounds: list[list[dict]] = []
    k_star = 0
    with tempfile.TemporaryDirectory(prefix="gpu-shaped-") as tmp:
        for n in range(args.rounds):
            work = Path(tmp) / f"round-{n}"
            work.mkdir()
            rows = [contender("plain", None, script + steps, work, args.timeout),
                    contender("cfrun_idle", ["--interval", str(IDLE_INTERVAL)],
                              script + steps, work, args.timeout),
                    contender("cfrun_policy", ["--overhead", "3.5%"],
                              script + ["--steps", str(args.steps + args.policy_steps)], work,
                              args.timeout)]
            if not k_star:  # from the first round's policy run: its persists
                plain_ms = statistics.mean(rows[0]["iter_ms"])
                pgts = [float(c.get("pgt_s") or 0) for c in rows[-1]["checkpoints"]]
                k_star = max(1, math.ceil(statistics.median(pgts) * 1e3 / plain_ms)) \
                    if pgts else 10
            for name, k in (("cfrun_k", k_star), ("cfrun_2k", 2 * k_star)):
                rows.append(contender(name, ["--interval", str(k)], script + steps, work,
                                      args.timeout))
            rows.append(contender("plain_after", None, script + steps, work, args.timeout))
            base_ms = statistics.mean(rows[0]["iter_ms"] + rows[-1]["iter_ms"])
            for r in rows:
                r["summary"] = per_checkpoint(r, base_ms)
                r["base_ms"] = base_ms
            rounds.append(rows)
    names = [r["name"] for r in rounds[0]]
    base_ms = statistics.median(r[0]["base_ms"] for r in rounds)
    print(f"gpu-shaped step on a CPU: {args.launches} launches, {args.device_ms:.0f} ms device "
          f"wait, state {rounds[0][0]['state_bytes'] / 1e6:.0f} MB; plain {base_ms:.1f} ms a "
          f"step, k* = {k_star}; medians over {args.rounds} round(s), each against its own "
          "plain runs")
    cols = [("mean_ms", "mean ms", 1), ("overhead", "overhead %", 100), ("checkpoints", "ckpts", 1),
            ("deferred", "defer", 1), ("stall_ms", "stall ms", 1), ("pgt_s", "pgt s", 1),
            ("boundary", "boundary", 1), ("next", "next", 1), ("persist", "persist", 1),
            ("total", "total", 1)]
    print(f"{'contender':<13}" + "".join(f"{h:>11}" for _, h, _ in cols)
          + "   (boundary..total: per-checkpoint cost in steps)")
    summary = {}
    for i, name in enumerate(names):
        med = {}
        for key, _, scale in cols:
            vals = [rs[i]["summary"].get(key) for rs in rounds]
            vals = [v * scale for v in vals if v is not None]
            med[key] = statistics.median(vals) if vals else None
        summary[name] = med
        print(f"{name:<13}" + "".join(f"{med[k]:>11.2f}" if med[k] is not None else f"{'-':>11}"
                                      for k, _, _ in cols))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                    "k_star": k_star, "summary": summary, "rounds": rounds},
                                   indent=1, default=str))
    print(f"raw results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
