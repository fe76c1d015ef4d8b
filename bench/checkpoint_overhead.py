"""Checkpoint overhead of cfrun against torch.save and torch.distributed.checkpoint (DCP).

What is measured
----------------
One training script, ``bench/_overhead_train.py`` (a ~10.5 M-parameter MLP trained with Adam
on CPU: ~126 MB of model + optimizer state, ~100-150 ms per iteration with 2 threads), is run
once per *contender* and checkpoint interval ``k``:

* ``none``: no checkpoints (the baseline);
* ``torch_save``: ``torch.save`` + ``fsync`` every k steps, synchronously;
* ``dcp_thread``: ``dcp.async_save`` every k steps, default thread executor;
* ``dcp_process``: ``dcp.async_save`` with the process executor and a reused shared-memory
  ``DefaultStager`` (pinned memory needs CUDA and is off);
* ``cfrun``: the unmodified script under ``cfrun --interval k`` (two-phase checkpoint: copy
  into a shared-memory slot overlapped with training, persist by a separate agent process).

All contenders run in *rounds*: each round runs every (contender, k) once, in a shuffled order,
so slow phases of this shared machine hit all contenders alike.

Per run the script reports ``ms_per_iter``: the mean wall time of one training iteration over
the timed iterations (the first 5 are warm-up), measured between consecutive arrivals at the
top of the loop body, so it includes the checkpoint call of the in-script contenders and
cfrun's work at the loop head and in the step. Per checkpoint: the *stall* (seconds the training
loop was blocked by checkpointing: the checkpoint call for in-script contenders, ``stall_s`` from
``events.jsonl`` for cfrun) and the *PGT* (persistence guarantee time: seconds from the start of
the checkpoint until it is durable on disk; for cfrun also ``snapshot_s`` and ``persist_s``).

How to read the table
---------------------
* ``ms/iter``: median over rounds of the per-run mean iteration time.
* ``overhead``: median over rounds of ``ms_per_iter(contender) / ms_per_iter(none) - 1`` with
  ``none`` from the same round; the ratio within a round cancels much of the machine's drift.
  Differences of a few percent are within noise on a 2-core shared machine.
* ``steady``: the same ratio over the iterations after the first checkpoint (``k + 1`` on),
  leaving out the one-time costs of the first checkpoint (slot allocation, model discovery,
  the agent's first connection), which a long run pays once.
* ``stall ms`` / ``PGT ms``: medians over all checkpoints of all rounds.
* ``ckpts``: checkpoints per run (median over rounds). cfrun keeps at most one checkpoint in
  flight and defers a due one to a later step, so at small k it can take fewer than steps/k.

Physical limits, measured in the same run, for scale:

* ``memcpy``: one copy of the full state's byte count into a preallocated, reused buffer
  (``dst.copy_(src)``, median of several); contrasted with a copy into freshly allocated memory
  (``torch.empty`` + copy, which pays the page faults). If that copy sat on the critical path of
  every k-th iteration, the overhead would be ``memcpy / (k * ms_per_iter(none))``.
* ``disk``: sequential write + fsync of the state's byte count to a new file in the job dirs'
  directory (16 MB chunks, median of 3). ``PGT floor = state bytes / disk bandwidth`` is the
  least time any checkpoint can take to become durable.

Targets (issue 3), printed PASS/FAIL for ``cfrun`` (and ``cfrun_inline``): steady overhead
<= 30% / 5% / 1% at k = 1 / 5 / 20; median stall per checkpoint <= 1.2 x memcpy; median PGT
<= 1.3 x state bytes / disk bandwidth + 50 ms (k > 1: at k = 1 a checkpoint queues behind the
previous persist); peak snapshot memory in /dev/shm, sampled every 50 ms while the run goes,
<= 2 x state bytes in one slot file per rank.

All raw numbers are saved as JSON (``bench/results/checkpoint_overhead.json`` by default).

Usage::

    .venv/bin/python bench/checkpoint_overhead.py            # 3 rounds x 60 steps (~10-15 min)
    .venv/bin/python bench/checkpoint_overhead.py --quick    # 1 round x 30 steps (smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
TRAIN_SCRIPT = BENCH_DIR / "_overhead_train.py"
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_OUT = RESULTS_DIR / "checkpoint_overhead.json"
CONTENDERS = ["none", "torch_save", "dcp_thread", "dcp_process", "cfrun", "cfrun_inline"]
"""``cfrun`` copies parameters and optimizer state in a background thread; ``cfrun_inline``
(``CFRUN_SNAPSHOT_MODE=inline``) copies them on the training thread: which is better on CPU."""
RUN_TIMEOUT_S = 600
WARMUP_ITERS = 5
"""Untimed iterations at the start of every run (``_overhead_train.WARMUP_ITERS``)."""
CHILD_ENV = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
RESULT_RE = re.compile(r"RESULT (\{.*\})\s*$")


# ---------------------------------------------------------------------------- helpers


def median(xs):
    """Median of a list, or None when it is empty."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def child_env():
    """Environment for the runs: ours plus 2 OMP threads, passive waiting, unbuffered output."""
    env = dict(os.environ)
    env.update(CHILD_ENV)
    return env


def dcp_process_available():
    """(available, note): whether DCP's process executor and a shared-memory stager exist."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as e:
        return False, f"dcp_process skipped: {e}"
    if not hasattr(AsyncCheckpointerType, "PROCESS"):
        return False, "dcp_process skipped: AsyncCheckpointerType.PROCESS missing"
    return True, ("dcp_process: AsyncCheckpointerType.PROCESS + DefaultStager(shared memory, "
                  "reused); pinned memory off (needs CUDA)")


def configs(ks, with_dcp_process, only=None):
    """The (contender, k) pairs of one round, ``none`` first (k=0); ``only`` limits contenders."""
    out = [("none", 0)]
    for name in CONTENDERS[1:]:
        if name == "dcp_process" and not with_dcp_process:
            continue
        if only and name not in only:
            continue
        out += [(name, k) for k in ks]
    return out


def state_bytes_of_script():
    """Bytes of model parameters + Adam state of the training script's model, counted after
    one optimizer step exactly as the script counts them."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import _overhead_train as t
    finally:
        sys.path.pop(0)
    model = t.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    n += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
             if torch.is_tensor(v))
    del model, opt
    return n


# ---------------------------------------------------------------------------- physical limits


def measure_memcpy(state_bytes, repeats=7):
    """Seconds for one copy of ``state_bytes`` into a reused buffer and into fresh memory.

    Returns a dict with the median and all samples of both (``torch.set_num_threads(2)``,
    like the training script)."""
    torch.set_num_threads(2)
    src = torch.ones(state_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in once
    reused_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        reused_s.append(time.perf_counter() - t0)
    del dst
    fresh_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fresh = torch.empty(state_bytes, dtype=torch.uint8)
        fresh.copy_(src)
        fresh_s.append(time.perf_counter() - t0)
        del fresh
    return {"reused_buffer_s": median(reused_s), "reused_buffer_samples_s": reused_s,
            "fresh_alloc_s": median(fresh_s), "fresh_alloc_samples_s": fresh_s}


def measure_disk(directory, state_bytes, chunk_bytes=16 << 20, repeats=3):
    """Sequential write + fsync bandwidth (bytes/s) of ``directory``'s disk: writes
    ``state_bytes`` to a new file in ``chunk_bytes`` chunks, fsyncs, closes; median of
    ``repeats``. Each file is deleted afterwards."""
    chunk = os.urandom(1 << 20) * (chunk_bytes >> 20)
    times_s = []
    for i in range(repeats):
        path = os.path.join(directory, f"disk-probe-{i}.bin")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = state_bytes
            while left > 0:
                n = os.write(fd, chunk[:min(left, chunk_bytes)])
                left -= n
            os.fsync(fd)
        finally:
            os.close(fd)
        times_s.append(time.perf_counter() - t0)
        os.remove(path)
    t = median(times_s)
    return {"write_fsync_s": t, "write_fsync_samples_s": times_s,
            "bandwidth_bytes_per_s": state_bytes / t, "chunk_bytes": chunk_bytes}


# ---------------------------------------------------------------------------- one run


def run_one(contender, k, steps, work_dir, index):
    """Run the training script once for (contender, k); returns a dict of raw results.

    ``work_dir`` is the run's temp dir; the checkpoint dir / job dir lives under it."""
    run_dir = Path(work_dir) / f"run-{index:03d}-{contender}-k{k}"
    run_dir.mkdir()
    script_args = ["--contender", contender, "--k", str(max(k, 1)), "--steps", str(steps)]
    job_dir = None
    env = child_env()
    if contender.startswith("cfrun"):
        if contender == "cfrun_inline":
            env["CFRUN_SNAPSHOT_MODE"] = "inline"
        job_dir = run_dir / "job"
        cmd = [sys.executable, "-m", "cfrun", "--interval", str(k), "--job-dir", str(job_dir),
               "--max-restarts", "0", str(TRAIN_SCRIPT), *script_args]
    else:
        cmd = [sys.executable, str(TRAIN_SCRIPT), *script_args,
               "--ckpt-dir", str(run_dir / "ckpt")]
    rec = {"contender": contender, "k": k, "cmd": cmd, "ok": False}
    t0 = time.perf_counter()
    prefix = slot_prefix_of(job_dir) if job_dir is not None else None
    proc, shm = run_sampling_shm(cmd, env, run_dir, prefix)
    if proc is None:
        rec["error"] = f"timed out after {RUN_TIMEOUT_S} s"
        return rec
    if shm is not None:
        rec["shm"] = shm
    rec["wall_s"] = time.perf_counter() - t0
    rec["returncode"] = proc.returncode
    result = None
    for line in proc.stdout.splitlines():
        m = RESULT_RE.search(line)
        if m:
            result = json.loads(m.group(1))
    if proc.returncode != 0 or result is None:
        rec["error"] = (f"exit {proc.returncode}" if proc.returncode != 0 else
                        "no RESULT line")
        rec["stdout_tail"] = proc.stdout[-2000:]
        rec["stderr_tail"] = proc.stderr[-3000:]
    if result is not None:
        rec["ms_per_iter"] = result["ms_per_iter"]
        rec["iter_ms"] = result["iter_ms"]
        rec["state_bytes"] = result["state_bytes"]
        rec["stall_s"] = result.get("stall_s", [])
        rec["pgt_s"] = result.get("pgt_s", [])
        rec["n_checkpoints"] = len(rec["stall_s"])
    if job_dir is not None:
        rec.update(read_cfrun_events(job_dir, k, steps))
        leftover = cfrun_leftover_slots(job_dir)
        if leftover:
            rec["leftover_slots"] = leftover
    if "error" not in rec:
        rec["ok"] = True
        # warnings on stderr are worth keeping (e.g. cfrun's "resume may not be exact")
        warn = [ln for ln in proc.stderr.splitlines() if "WARNING" in ln]
        if warn:
            rec["stderr_warnings"] = warn[:20]
    return rec


def read_cfrun_events(job_dir, k, steps):
    """Checkpoint measurements from a cfrun job's ``events.jsonl``, plus any oddities."""
    out = {"stall_s": [], "pgt_s": [], "snapshot_s": [], "persist_s": [], "ckpt_bytes": [],
           "ckpt_steps": [], "other_events": {}}
    path = Path(job_dir) / "events.jsonl"
    if not path.exists():
        out["error"] = f"no events.jsonl in {job_dir}"
        return out
    commits = []
    for line in path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            out.setdefault("bad_event_lines", []).append(line[:200])
            continue
        kind = ev.get("event")
        if kind == "checkpoint":
            out["stall_s"].append(ev.get("stall_s"))
            out["pgt_s"].append(ev.get("pgt_s"))
            out["snapshot_s"].append(ev.get("snapshot_s"))
            out["persist_s"].append(ev.get("persist_s"))
            out["ckpt_bytes"].append(ev.get("bytes"))
            out["ckpt_steps"].append(ev.get("step"))
        elif kind == "commit":
            commits.append(ev.get("step"))
        else:
            out["other_events"][kind] = out["other_events"].get(kind, 0) + 1
            if kind in ("not_exact", "checkpoint_failed", "checkpoint_lost", "error"):
                out.setdefault("notable_events", []).append(ev)
    out["n_checkpoints"] = len(out["stall_s"])
    out["commit_steps"] = commits
    missing = sorted(set(commits) - set(out["ckpt_steps"]))
    if missing:
        out["commits_without_checkpoint_event"] = missing
    return out


def slot_prefix_of(job_dir):
    """File-name prefix of a cfrun job's shared-memory snapshot slots in /dev/shm."""
    from cfrun.rank.slot import slot_prefix

    return slot_prefix(Path(job_dir))


def run_sampling_shm(cmd, env, cwd, prefix, period_s=0.05):
    """Run ``cmd`` to completion; while it runs, sample the slot files in /dev/shm's
    ``prefix_*/`` (cfrun's private snapshot slot directory) every ``period_s``.

    Returns (CompletedProcess or None on timeout, shm) where shm is None without a prefix,
    else ``{"peak_bytes": largest total size seen at once, "files": every slot file name
    seen, "sizes": {name: largest size}}``: the host memory cfrun's snapshots used, and
    whether slots were allocated once (one file per rank, never re-created under a new name)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, env=env, cwd=str(cwd), stdout=out, stderr=err, text=True)
        peak, sizes = 0, {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while p.poll() is None:
            if time.monotonic() > deadline:
                p.kill()
                p.wait()
                return None, None
            if prefix is not None:
                total = 0
                for f in Path("/dev/shm").glob(prefix + "_*/*.slot"):  # the job's private dir
                    try:
                        n = f.stat().st_size
                    except OSError:
                        continue
                    total += n
                    sizes[f.name] = max(n, sizes.get(f.name, 0))
                peak = max(peak, total)
            time.sleep(period_s)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read())
    shm = None if prefix is None else {"peak_bytes": peak, "files": sorted(sizes),
                                       "sizes": sizes}
    return proc, shm


def cfrun_leftover_slots(job_dir):
    """Shared-memory slot files of this job still present after cfrun exited (should be none)."""
    try:
        from cfrun.rank.slot import slot_prefix
    except ImportError:
        return []
    prefix = slot_prefix(Path(job_dir))
    return sorted(str(p) for p in Path("/dev/shm").glob(prefix + "*"))


# ---------------------------------------------------------------------------- summary


def summarize(runs, limits, ks):
    """Per (contender, k): medians over rounds / checkpoints; returns a list of row dicts."""
    by_round = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[(r["contender"], r["k"])] = r
    keys = []
    for r in runs:
        if (r["contender"], r["k"]) not in keys:
            keys.append((r["contender"], r["k"]))
    keys.sort(key=lambda ck: (CONTENDERS.index(ck[0]), ck[1]))
    rows = []
    for c, k in keys:
        mine = [rr[(c, k)] for rr in by_round.values() if (c, k) in rr]
        ok = [r for r in mine if r.get("ok")]
        ratios, steady = [], []
        for rr in by_round.values():
            a, b = rr.get((c, k)), rr.get(("none", 0))
            if a and b and a.get("ok") and b.get("ok"):
                ratios.append(a["ms_per_iter"] / b["ms_per_iter"] - 1.0)
                if c != "none":
                    lo = max(0, k + 1 - WARMUP_ITERS)
                    xa, xb = a["iter_ms"][lo:], b["iter_ms"][lo:len(a["iter_ms"])]
                    if xa and xb:
                        steady.append(statistics.fmean(xa) / statistics.fmean(xb) - 1.0)
        pooled = lambda key: [x for r in ok for x in r.get(key, []) if x is not None]  # noqa: E731, B023
        rows.append({
            "contender": c, "k": k, "runs": len(mine), "failed": len(mine) - len(ok),
            "ms_per_iter": median([r["ms_per_iter"] for r in ok]),
            "ms_per_iter_per_round": [r.get("ms_per_iter") for r in mine],
            "overhead": median(ratios), "overhead_per_round": ratios,
            "steady_overhead": median(steady), "steady_overhead_per_round": steady,
            "stall_ms": _ms(median(pooled("stall_s"))),
            "stall_ms_max": _ms(max(pooled("stall_s"), default=None)),
            "pgt_ms": _ms(median(pooled("pgt_s"))),
            "snapshot_ms": _ms(median(pooled("snapshot_s"))),
            "persist_ms": _ms(median(pooled("persist_s"))),
            "n_checkpoints": median([r.get("n_checkpoints") for r in ok]),
            "ckpt_bytes": median(pooled("ckpt_bytes")),
            "errors": [r.get("error") for r in mine if not r.get("ok")],
            "shm_peak_bytes": max((r["shm"]["peak_bytes"] for r in ok if r.get("shm")),
                                  default=None),
            "shm_files": max((len(r["shm"]["files"]) for r in ok if r.get("shm")),
                             default=None),
        })
    return rows


TARGET_OVERHEAD = {1: 0.30, 5: 0.05, 20: 0.01}
"""Issue 3's overhead targets per checkpoint interval k."""


def check_targets(rows, limits, state_bytes, contender="cfrun"):
    """Issue 3's four targets for ``contender``: a list of (name, passed or None when not
    measured, detail). Overhead at each k of :data:`TARGET_OVERHEAD`; median stall per
    checkpoint <= 1.2 x one memcpy of the state into a reused buffer; median PGT <= 1.3 x
    state bytes / measured write+fsync bandwidth + 50 ms; peak snapshot memory in /dev/shm
    <= 2 x state bytes with one slot file per rank (allocated once, never re-created)."""
    mine = {r["k"]: r for r in rows if r["contender"] == contender}
    out = []
    for k, limit in TARGET_OVERHEAD.items():
        r = mine.get(k)
        ovh = r and r["steady_overhead"]
        out.append((f"overhead at k={k} <= {100 * limit:.0f}%",
                    None if ovh is None else ovh <= limit,
                    "not run" if ovh is None else f"{100 * ovh:+.1f}% after the first "
                    f"checkpoint (per round: "
                    f"{', '.join(f'{100 * x:+.1f}%' for x in r['steady_overhead_per_round'])}); "
                    f"whole run incl. the first checkpoint's one-time costs "
                    f"{100 * r['overhead']:+.1f}%"))
    memcpy_ms = 1e3 * limits["memcpy"]["reused_buffer_s"]
    stalls = [r["stall_ms"] for r in mine.values() if r["stall_ms"] is not None]
    worst = max(stalls, default=None)
    out.append(("stall per checkpoint <= 1.2 x memcpy",
                None if worst is None else worst <= 1.2 * memcpy_ms,
                "not run" if worst is None else
                f"largest median stall over k {worst:.1f} ms vs 1.2 x {memcpy_ms:.1f} ms = "
                f"{1.2 * memcpy_ms:.1f} ms"))
    floor_ms = 1e3 * state_bytes / limits["disk"]["bandwidth_bytes_per_s"]
    pgt_limit_ms = 1.3 * floor_ms + 50
    pgts = {k: r["pgt_ms"] for k, r in mine.items() if r["pgt_ms"] is not None}
    # at k=1 a new checkpoint waits for the previous persist: PGT there includes that queue
    judged = {k: v for k, v in pgts.items() if k > 1} or pgts
    worst_pgt = max(judged.values(), default=None)
    out.append(("PGT <= 1.3 x bytes / bandwidth + 50 ms",
                None if worst_pgt is None else worst_pgt <= pgt_limit_ms,
                "not run" if worst_pgt is None else
                f"largest median PGT (k>1) {worst_pgt:.0f} ms vs 1.3 x {floor_ms:.0f} + 50 = "
                f"{pgt_limit_ms:.0f} ms; all k: "
                + ", ".join(f"k={k}: {v:.0f}" for k, v in sorted(pgts.items()))))
    peaks = [r["shm_peak_bytes"] for r in mine.values() if r.get("shm_peak_bytes")]
    files = max((r["shm_files"] or 0 for r in mine.values()), default=0)
    peak = max(peaks, default=None)
    out.append(("snapshot host memory <= 2 x state, allocated once",
                None if peak is None else peak <= 2 * state_bytes and files <= 1,
                "not sampled" if peak is None else
                f"peak {peak / 1e6:.1f} MB in {files} slot file(s) = "
                f"{peak / state_bytes:.2f} x state {state_bytes / 1e6:.1f} MB"))
    return out


def print_targets(targets, contender):
    """One PASS/FAIL line per target."""
    print(f"targets (issue 3, contender {contender}):")
    for name, ok, detail in targets:
        word = "n/a " if ok is None else ("PASS" if ok else "FAIL")
        print(f"  {word}  {name}: {detail}")


def _ms(s):
    return None if s is None else 1e3 * s


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(rows, limits, ks, state_bytes):
    """Print the results table and the physical-limit lines."""
    headers = ["contender", "k", "ms/iter", "overhead", "steady", "stall ms", "PGT ms", "snapshot ms",
               "persist ms", "ckpts", "failed"]
    body = []
    for r in rows:
        body.append([
            r["contender"], "-" if r["contender"] == "none" else str(r["k"]),
            _fmt(r["ms_per_iter"], ".1f"),
            "-" if r["contender"] == "none" else (
                "-" if r["overhead"] is None else f"{100 * r['overhead']:+.1f}%"),
            "-" if r.get("steady_overhead") is None else f"{100 * r['steady_overhead']:+.1f}%",
            _fmt(r["stall_ms"], ".1f"), _fmt(r["pgt_ms"], ".1f"),
            _fmt(r["snapshot_ms"], ".1f"), _fmt(r["persist_ms"], ".1f"),
            _fmt(r["n_checkpoints"], "g"), str(r["failed"]) if r["failed"] else "",
        ])
    try:
        from rich.console import Console
        from rich.table import Table
        table = Table(title="checkpoint overhead (medians)")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        prev = None
        for row, r in zip(body, rows):
            if prev is not None and r["contender"] != prev:
                table.add_section()
            prev = r["contender"]
            table.add_row(*row)
        Console(width=120).print(table)
    except ImportError:
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for b in body:
            print("  ".join(x.rjust(w) for x, w in zip(b, widths)))

    none = next((r for r in rows if r["contender"] == "none"), None)
    base_ms = none["ms_per_iter"] if none else None
    mc = limits["memcpy"]
    print(f"state: {state_bytes} bytes ({state_bytes / 1e6:.1f} MB, model + Adam state)")
    line = (f"memcpy of the state into a reused buffer: {1e3 * mc['reused_buffer_s']:.1f} ms "
            f"({state_bytes / mc['reused_buffer_s'] / 1e9:.2f} GB/s)")
    if base_ms:
        line += "; as % of iteration time / k: " + ", ".join(
            f"k={k}: {100 * 1e3 * mc['reused_buffer_s'] / (k * base_ms):.1f}%" for k in ks)
    print(line)
    print(f"copy into fresh memory (torch.empty + copy_): {1e3 * mc['fresh_alloc_s']:.1f} ms "
          f"({state_bytes / mc['fresh_alloc_s'] / 1e9:.2f} GB/s, "
          f"{mc['fresh_alloc_s'] / mc['reused_buffer_s']:.1f}x the reused-buffer copy)")
    dk = limits["disk"]
    print(f"disk write+fsync of the state ({dk['chunk_bytes'] >> 20} MB chunks): "
          f"{1e3 * dk['write_fsync_s']:.1f} ms = {dk['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; "
          f"predicted PGT floor = state bytes / bandwidth = {1e3 * dk['write_fsync_s']:.1f} ms")


# ---------------------------------------------------------------------------- main


def main(argv=None):
    """Parse options, measure the limits, run all rounds, print and save the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ks", default="1,5,20", help="checkpoint intervals, comma separated")
    ap.add_argument("--quick", action="store_true", help="1 round, 30 steps (smoke run)")
    ap.add_argument("--contenders", default="",
                    help="comma-separated subset, e.g. cfrun,cfrun_inline,torch_save (none is "
                         "always run)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the round order shuffle")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file for the raw numbers")
    ap.add_argument("--tmp-root", default=str(RESULTS_DIR / "tmp"),
                    help="where run dirs are created (same disk as the repository)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 30
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)

    with_dcp_process, dcp_note = dcp_process_available()
    print(dcp_note, flush=True)
    Path(args.tmp_root).mkdir(parents=True, exist_ok=True)
    state_bytes = state_bytes_of_script()

    t_start = time.perf_counter()
    runs = []
    work_dir = tempfile.mkdtemp(prefix="ckpt-overhead-", dir=args.tmp_root)
    try:
        print("measuring physical limits...", flush=True)
        limits = {"memcpy": measure_memcpy(state_bytes),
                  "disk": measure_disk(work_dir, state_bytes)}
        round_configs = configs(ks, with_dcp_process, args.contenders.split(",")
                                if args.contenders else None)
        index = 0
        for rnd in range(args.rounds):
            order = list(round_configs)
            random.Random(args.seed * 1000 + rnd).shuffle(order)
            for c, k in order:
                rec = run_one(c, k, args.steps, work_dir, index)
                rec["round"] = rnd
                rec["order"] = index
                runs.append(rec)
                index += 1
                status = (f"{rec['ms_per_iter']:.1f} ms/iter, {rec.get('n_checkpoints', 0)} ckpts"
                          if rec.get("ok") else f"FAILED: {rec.get('error')}")
                print(f"[round {rnd + 1}/{args.rounds}] {c:<11} k={k:<3} {status} "
                      f"({rec.get('wall_s', 0):.1f} s)", flush=True)
                # free the disk between runs
                for p in Path(work_dir).glob(f"run-{index - 1:03d}-*"):
                    shutil.rmtree(p, ignore_errors=True)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    total_s = time.perf_counter() - t_start

    rows = summarize(runs, limits, ks)
    print()
    print(f"command: {command}")
    print(f"{args.rounds} round(s) x {args.steps} steps, first 5 iterations not timed; "
          f"total {total_s / 60:.1f} min; torch {torch.__version__}; {os.cpu_count()} CPUs")
    print_table(rows, limits, ks, state_bytes)
    targets = {c: check_targets(rows, limits, state_bytes, c) for c in ("cfrun", "cfrun_inline")
               if any(r["contender"] == c for r in rows)}
    for c, t in targets.items():
        print_targets(t, c)
    for r in runs:
        if not r.get("ok"):
            print(f"FAILED round {r['round'] + 1} {r['contender']} k={r['k']}: {r.get('error')}")
            tail = (r.get("stderr_tail") or "").strip().splitlines()[-8:]
            for ln in tail:
                print(f"    {ln}")
    odd = [r for r in runs if r.get("notable_events") or r.get("leftover_slots")
           or r.get("commits_without_checkpoint_event") or r.get("stderr_warnings")]
    for r in odd:
        notes = []
        if r.get("notable_events"):
            notes.append("events: " + "; ".join(
                f"{e.get('event')}: {e.get('reason') or e.get('error')}"
                for e in r["notable_events"]))
        if r.get("commits_without_checkpoint_event"):
            notes.append(f"commits without checkpoint event at steps "
                         f"{r['commits_without_checkpoint_event']}")
        if r.get("leftover_slots"):
            notes.append(f"leftover shm slots {r['leftover_slots']}")
        if r.get("stderr_warnings") and not r.get("notable_events"):
            notes.append("stderr: " + " | ".join(r["stderr_warnings"][:3]))
        print(f"note: round {r['round'] + 1} {r['contender']} k={r['k']}: " + "; ".join(notes))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": command, "rounds": args.rounds, "steps": args.steps, "ks": ks,
        "state_bytes": state_bytes, "torch": torch.__version__, "cpus": os.cpu_count(),
        "child_env": CHILD_ENV, "dcp_process_note": dcp_note, "total_s": total_s,
        "limits": limits, "summary": rows, "runs": runs,
        "targets": {c: [{"target": n, "passed": ok, "detail": d} for n, ok, d in t]
                    for c, t in targets.items()},
    }, indent=1))
    print(f"raw numbers: {out}")


if __name__ == "__main__":
    main()
