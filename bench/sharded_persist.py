"""Sharded persist (DeepFreeze 1/N) against rank-0-only and every-rank-whole persist, 1/2/4 ranks.

What is measured
----------------
``bench/_sharded_train.py`` (DDP, gloo, an MLP of ~6.9 M parameters with the default
``--hidden 2500``: ~55 MB of parameters + ~55 MB of SGD momentum) runs under
``cfrun --nproc-per-node N --interval K`` for N in 1, 2, 4 and three layouts of the replicated
state (``CFRUN_SHARD``):

* ``sharded`` (cfrun's default): rank r snapshots and persists slice r of N of every parameter
  and momentum tensor, along its largest dimension;
* ``rank0``: rank 0 snapshots and persists them whole, the other ranks only their own small
  state (RNG, loader position): what "save on rank 0" amounts to;
* ``all``: every rank snapshots and persists everything (N copies).

Per checkpoint and rank (``checkpoint`` / ``checkpoint_rank`` events, ``CFRUN_EVENTS_ALL_RANKS=1``):
``stall_s`` (the training loop's wait) and ``pgt_s`` (trigger to durable commit of the whole
step: with one agent per node, the commit waits for every rank's shard). The table gives, per N
and layout, the median over ranks and checkpoints of the *slowest* rank's stall (the others wait
for it at the next collective), the median PGT, the bytes each rank writes, ms/iter, and the
ratios sharded / rank0 and sharded / all. Rounds run all (N, layout) pairs in a shuffled order.

Usage::

    .venv/bin/python bench/sharded_persist.py             # 2 rounds x 40 steps (~6 min)
    .venv/bin/python bench/sharded_persist.py --quick     # 1 round x 20 steps
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LAYOUTS = {"sharded": "1", "rank0": "rank0", "all": "0"}


def run_one(world: int, layout: str, steps: int, interval: int, hidden: int, tmp: Path) -> dict:
    job = Path(tempfile.mkdtemp(prefix=f"n{world}-{layout}-", dir=tmp))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CFRUN_")}
    env.update({"CFRUN_SHARD": LAYOUTS[layout], "CFRUN_EVENTS_ALL_RANKS": "1",
                "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "cfrun", "--job-dir", str(job / "job"), "--max-restarts", "0",
           "--nproc-per-node", str(world), "--interval", str(interval),
           str(ROOT / "bench" / "_sharded_train.py"), "--steps", str(steps), "--hidden",
           str(hidden)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{layout} N={world} failed:\n{p.stderr[-3000:]}")
    events = [json.loads(l) for l in (job / "job" / "events.jsonl").read_text().splitlines()
              if l.strip()]
    per_step: dict[int, list[dict]] = {}
    for e in events:
        if e["event"] in ("checkpoint", "checkpoint_rank"):
            per_step.setdefault(e["step"], []).append(e)
    full = {s: es for s, es in per_step.items() if len(es) == world}
    bins = {}
    ckpts = sorted((job / "job" / "checkpoints").glob("step-*"))
    if ckpts:
        for f in ckpts[-1].glob("rank-*.bin"):
            bins[f.name] = f.stat().st_size
    ms = [float(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("ms_per_iter")]
    return {"world": world, "layout": layout, "wall_s": time.monotonic() - t0,
            "ms_per_iter": ms[0] if ms else None, "checkpoints": len(full),
            "max_stall_s": [max(float(e["stall_s"]) for e in es) for es in full.values()],
            "pgt_s": [max(float(e["pgt_s"]) for e in es) for es in full.values()],
            "bin_bytes_per_rank": bins}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2500)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "sharded_persist.json"))
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 20, 1
    worlds = [int(w) for w in args.worlds.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sharded-", dir=RESULTS))
    runs = []
    rng = random.Random(0)
    for r in range(args.rounds):
        pairs = [(w, lay) for w in worlds for lay in LAYOUTS if w > 1 or lay == "sharded"]
        rng.shuffle(pairs)
        for w, lay in pairs:
            res = run_one(w, lay, args.steps, args.interval, args.hidden, tmp)
            res["round"] = r
            runs.append(res)
            print(f"  round {r} N={w} {lay:8s} {res['ms_per_iter']:.1f} ms/iter, "
                  f"{res['checkpoints']} ckpts, stall {statistics.median(res['max_stall_s']) * 1e3:.1f} ms, "
                  f"PGT {statistics.median(res['pgt_s']) * 1e3:.0f} ms", flush=True)

    def agg(w: int, lay: str) -> dict | None:
        rs = [r for r in runs if r["world"] == w and r["layout"] == lay]
        if not rs:
            return None
        return {"stall_ms": statistics.median([s for r in rs for s in r["max_stall_s"]]) * 1e3,
                "pgt_ms": statistics.median([s for r in rs for s in r["pgt_s"]]) * 1e3,
                "ms_per_iter": statistics.median([r["ms_per_iter"] for r in rs]),
                "max_rank_mb": max(max(r["bin_bytes_per_rank"].values(), default=0)
                                   for r in rs) / 1e6}

    table = {}
    print("\n   N  layout    ms/iter  max stall ms   PGT ms  largest rank file MB  "
          "stall ratio  PGT ratio  (ratios: sharded / this layout)")
    for w in worlds:
        base = agg(w, "sharded")
        for lay in LAYOUTS:
            a = agg(w, lay)
            if a is None:
                continue
            table[f"{w}/{lay}"] = a
            st = base["stall_ms"] / a["stall_ms"] if a["stall_ms"] else float("nan")
            pg = base["pgt_ms"] / a["pgt_ms"] if a["pgt_ms"] else float("nan")
            print(f"  {w:2d}  {lay:8s} {a['ms_per_iter']:8.1f} {a['stall_ms']:13.2f} "
                  f"{a['pgt_ms']:8.0f} {a['max_rank_mb']:21.1f}  {st:11.2f}  {pg:9.2f}")
    Path(args.out).write_text(json.dumps({"args": vars(args), "table": table, "runs": runs},
                                         indent=1))
    print(f"raw numbers: {args.out}")


if __name__ == "__main__":
    main()
