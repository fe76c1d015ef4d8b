"""PGT and stall with the peer tier (ACUTE level 1) against direct writes to network storage.

What is measured
----------------
Two contenders persist the same checkpoints of the same simulated training, side by side in one
run, on this machine's loopback:

* ``direct``: the persist agent writes every rank's shard to the job dir, which stands for
  network storage (EBS/EFS/NFS): writes are **throttled to ~100 MB/s** by a token bucket in the
  writer (fault point ``storage.throttle_bytes_per_s``; a *simulation*: the disk itself is faster);
* ``peer``: ``cfrun --peer``: the agent sends each rank's shard to a ``cfrun peer`` on
  127.0.0.1 in ``S`` parallel parts (shards per rank, ACUTE's sharding degree), one TCP
  connection each; the peer keeps them in RAM (*protected*, where PGT ends) and flushes them
  FIFO to the same throttled ~100 MB/s storage (*durable*).

Training is simulated, not faked: ``R`` rank threads (R = 1, 2, 4) each own a real
``cfrun.rank.snapshot.Snapshotter`` (shared-memory slot, background copy, hand-off to the real agent
process over its socket) and a ``--state-mb`` state of real tensors; an iteration is a sleep of
``--iter-ms`` (no CPU use, so the 2 shared cores go to cfrun); every ``--interval`` iterations
all ranks checkpoint the same step, with cfrun's rules (at most one checkpoint in flight; a
second rank waits for the previous one, one rank defers it).

Per checkpoint: **PGT** (seconds from the trigger until the checkpoint survives the loss of the
training node: for ``direct`` the commit on the storage, for ``peer`` all shards in peer RAM) and
**stall** (seconds the rank's loop was blocked: hand-off, waiting for the previous checkpoint,
the next step's gate). ``durable`` is trigger -> on the throttled storage (peer only; for direct
it equals PGT).

Ratios are ``peer / direct`` with the same number of ranks: below 1 is better for the peer.
Reading them: loopback is not a network (no NIC, no 10 Gb/s cap), and 2 shared CPU cores bound
what parallel streams can gain here; in steady state the flush bandwidth still bounds how often
checkpoints can become *durable*: the peer tier shortens the window in which a VM loss loses a
checkpoint (PGT), and absorbs bursts up to ``--slots`` checkpoints.

Usage::

    nice -n 19 .venv/bin/python bench/peer_tier.py            # R=1,2,4 x S=1..8 (~5 min)
    nice -n 19 .venv/bin/python bench/peer_tier.py --quick    # R=1,2 x S=1,4 (smoke run)

Raw numbers: ``bench/results/peer_tier.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_OUT = RESULTS_DIR / "peer_tier.json"
sys.path.insert(0, str(BENCH_DIR.parent))

from cfrun.contract import faults, ipc  # noqa: E402
from cfrun.contract.jobdir import JobDir  # noqa: E402
from cfrun.rank.slot import remove_slots  # noqa: E402
from cfrun.rank.snapshot import Snapshotter  # noqa: E402


def start_peer(work: Path, token: Path, throttle: int, slots: int, max_bytes: int
               ) -> tuple[subprocess.Popen[str], str, list[str]]:
    env = faults.arm(dict(os.environ), **{"storage.throttle_bytes_per_s": throttle})
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "peer", "--listen", "127.0.0.1:0", "--flush-to",
         str(work / "level2"), "--token-file", str(token), "--slots", str(slots),
         "--max-checkpoint-bytes", str(max_bytes)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in lines:
            m = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
            if m:
                return proc, m.group(1), lines
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"cfrun peer did not start: {lines}")


def start_agent(job_dir: Path, throttle: int, peer: str | None, token: Path, streams: int
                ) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "cfrun.agent", "--job-dir", str(job_dir), "--keep", "2"]
    if peer:
        argv += ["--peer", peer, "--peer-token-file", str(token), "--peer-streams", str(streams)]
    env = faults.arm(dict(os.environ), **{"storage.throttle_bytes_per_s": throttle})
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ipc.connect(job_dir, timeout_s=1.0).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("agent exited") from None
            time.sleep(0.05)
    raise RuntimeError("agent did not start")


def run_config(tier: str, ranks: int, streams: int, args: argparse.Namespace, work: Path,
               peer: str | None, token: Path) -> dict[str, Any]:
    """One contender for one (ranks, streams): simulated training, real snapshots and agent."""
    job_dir = work / f"{tier}-r{ranks}-s{streams}"
    jd = JobDir(job_dir)
    jd.create()
    agent = start_agent(job_dir, args.bandwidth_mb_s * 1_000_000, peer if tier == "peer" else None,
                        token, streams)
    numel = args.state_mb * (1 << 20) // 4 // 2
    records: list[list[dict[str, Any]]] = [[] for _ in range(ranks)]
    stalls: list[list[float]] = [[] for _ in range(ranks)]
    deferred = [0] * ranks
    barrier = threading.Barrier(ranks)
    errors: list[str] = []

    def rank_loop(rank: int) -> None:
        try:
            torch.manual_seed(rank)
            tensors = [torch.randn(numel), torch.randn(numel)]
            snap = Snapshotter(job_dir, rank, ranks, 0, records[rank].append)
            if not snap.ready():
                raise RuntimeError("agent not ready")
            tree = {"state": [{"__t__": 0}, {"__t__": 1}]}
            ids = {id(t) for t in tensors}
            blocked = 0.0
            for it in range(1, args.iters + 1):
                time.sleep(args.iter_ms / 1000)  # compute (no CPU)
                t0 = time.perf_counter()
                snap.gate()
                blocked += time.perf_counter() - t0
                with torch.no_grad():
                    for t in tensors:
                        t.add_(1e-3)  # the optimizer step
                if it % args.interval:
                    continue
                barrier.wait()  # all ranks reach the same step boundary
                t0 = time.perf_counter()
                if snap.busy():
                    if ranks == 1:
                        deferred[rank] += 1
                        continue
                    snap.persist_done.wait()  # ranks must checkpoint the same steps
                meta = {"step": it, "mode": "loop", "epoch": None, "batches": None,
                        "not_exact": [], "world_size": ranks}
                snap.start(it, tree, tensors, ids, meta, time.time(), t0)
                blocked += time.perf_counter() - t0
                stalls[rank].append(blocked)
                blocked = 0.0
            snap.close(timeout_s=120)
            if blocked:
                stalls[rank][-1] += blocked  # the last checkpoint's gate
        except Exception as e:  # reported, not raised (the other ranks must finish)
            errors.append(f"rank {rank}: {e!r}")
            barrier.abort()

    t0 = time.monotonic()
    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    agent.send_signal(signal.SIGTERM)
    agent.wait(120)
    remove_slots(job_dir)
    wall_s = time.monotonic() - t0
    events = jd.read_events()
    pgt = [float(r["pgt_s"]) for rec in records for r in rec]
    stall = [s for st in stalls for s in st]
    tiers = sorted({r.get("tier", "?") for rec in records for r in rec})
    if tier == "peer":
        durable = [float(e["durable_s"]) for e in events if e.get("event") == "durable"]
    else:
        durable = [float(e["pgt_s"]) for e in events if e.get("event") == "commit"]
    out = {"tier": tier, "ranks": ranks, "streams": streams, "wall_s": round(wall_s, 3),
           "checkpoints": len(records[0]), "deferred": deferred[0], "tiers_used": tiers,
           "pgt_s": pgt, "stall_s": stall, "durable_s": durable,
           "pgt_median_s": statistics.median(pgt) if pgt else None,
           "stall_median_s": statistics.median(stall) if stall else None,
           "stall_mean_s": statistics.fmean(stall) if stall else None,
           "durable_median_s": statistics.median(durable) if durable else None,
           "errors": errors,
           "warnings": [e for e in events if e.get("event") in ("peer_unavailable",
                                                                 "persist_failed")]}
    shutil.rmtree(job_dir, ignore_errors=True)
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--streams", default="1,2,3,4,5,6,7,8", help="shards per rank (peer)")
    ap.add_argument("--state-mb", type=int, default=16, help="state per rank, MiB")
    ap.add_argument("--iter-ms", type=float, default=40.0)
    ap.add_argument("--interval", type=int, default=10, help="iterations between checkpoints")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--bandwidth-mb-s", type=int, default=100,
                    help="simulated network storage bandwidth, MB/s")
    ap.add_argument("--slots", type=int, default=4, help="peer --slots")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.streams, args.iters = "1,2", "1,4", 40
    ranks_list = [int(x) for x in args.ranks.split(",")]
    streams_list = [int(x) for x in args.streams.split(",")]
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="peer-tier-", dir=RESULTS_DIR))
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    max_bytes = max(ranks_list) * (args.state_mb + 1) << 20
    peer_proc, peer_addr, peer_log = start_peer(work, token, args.bandwidth_mb_s * 1_000_000,
                                                args.slots, max_bytes)
    t_start = time.monotonic()
    runs = []
    try:
        for ranks in ranks_list:
            configs = [("direct", 1)] + [("peer", s) for s in streams_list]
            for tier, streams in configs:
                rec = run_config(tier, ranks, streams, args, work, peer_addr, token)
                runs.append(rec)
                print(f"{tier:<6} ranks={ranks} shards/rank={streams if tier == 'peer' else '-'}: "
                      f"PGT {_ms(rec['pgt_median_s'])} ms, stall {_ms(rec['stall_median_s'])} ms, "
                      f"durable {_ms(rec['durable_median_s'])} ms, {rec['checkpoints']} ckpts "
                      f"{rec['tiers_used']} ({rec['wall_s']:.1f} s)"
                      + (f" ERRORS {rec['errors']}" if rec["errors"] else ""), flush=True)
    finally:
        peer_proc.send_signal(signal.SIGTERM)
        try:
            peer_proc.wait(60)
        except subprocess.TimeoutExpired:
            peer_proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    total_s = time.monotonic() - t_start

    print()
    print(f"command: {command}")
    print(f"state {args.state_mb} MiB per rank, iteration {args.iter_ms:g} ms (sleep), checkpoint "
          f"every {args.interval} iterations, {args.iters} iterations; storage throttled to "
          f"{args.bandwidth_mb_s} MB/s (simulated); peer on loopback, --slots {args.slots}; "
          f"{os.cpu_count()} CPUs; total {total_s / 60:.1f} min")
    print("ratios are peer / direct (same ranks); < 1: the peer tier is better")
    headers = ["ranks", "shards/rank", "PGT direct ms", "PGT peer ms", "PGT ratio",
               "stall direct ms", "stall peer ms", "stall ratio", "durable peer ms"]
    rows = []
    for ranks in ranks_list:
        d = next(r for r in runs if r["tier"] == "direct" and r["ranks"] == ranks)
        for r in runs:
            if r["tier"] != "peer" or r["ranks"] != ranks:
                continue
            rows.append([str(ranks), str(r["streams"]), _ms(d["pgt_median_s"]),
                         _ms(r["pgt_median_s"]), _ratio(r["pgt_median_s"], d["pgt_median_s"]),
                         _ms(d["stall_median_s"]), _ms(r["stall_median_s"]),
                         _ratio(r["stall_median_s"], d["stall_median_s"]),
                         _ms(r["durable_median_s"])])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))
    notes = [r for r in runs if r["errors"] or r["warnings"]]
    for r in notes:
        print(f"note: {r['tier']} ranks={r['ranks']} streams={r['streams']}: "
              f"{r['errors']} {[w.get('event') for w in r['warnings']]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "args": vars(args), "total_s": total_s,
                               "cpus": os.cpu_count(), "torch": torch.__version__,
                               "rows": [dict(zip(headers, row)) for row in rows],
                               "runs": runs, "peer_log_tail": peer_log[-50:]}, indent=1))
    print(f"raw numbers: {out}")


if __name__ == "__main__":
    main()
