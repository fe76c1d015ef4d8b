"""How cfrun's checkpoint costs grow with the state: 0.1 to 6 GB, against torch.save and DCP.

What is measured
----------------
One training script, ``bench/_scaling_train.py`` (an embedding table with dense Adam, one
thread: ~12 bytes of state per parameter, a step that costs about three passes over the state's
memory and no compute), is run at each state size of ``--sizes`` (GB, default 0.1,0.5,2) once
per *contender*, one after another (never two at once: the machine's memory is the limit):

* ``none``: no checkpoints (the baseline);
* ``torch_save``: ``torch.save`` + ``fsync`` every k steps on the training thread;
* ``dcp_thread`` / ``dcp_process``: ``dcp.async_save`` every k steps (thread executor; process
  executor with a reused shared-memory stager, where this torch has it);
* ``cfrun``: the unmodified script under ``cfrun --interval k``;
* ``cfrun_policy``: under ``cfrun --overhead 3.5%`` (the policy picks k).

The contenders are ``bench/_overhead_train.py``'s (its ``Checkpointer``); the run, the
``/dev/shm`` sampling, the events and the physical limits are ``bench/checkpoint_overhead.py``'s
helpers. A contender whose estimated peak host memory (the process's measured ``max_rss`` per
state byte at the previous size, else 2.2x the state, plus one more state copy for those that
stage one) exceeds ``--mem-limit-gb`` is skipped with the reason printed.

After each checkpointing run, a separate process times a resume's load of the newest
checkpoint (``_scaling_train.py --load``) after dropping its files from the page cache.

Per size and contender: ``ms/iter`` (mean after 3 warm-up iterations), ``overhead`` against
``none``'s same iterations (whole run) and ``steady`` (iterations after the first checkpoint;
for ``cfrun_policy``, which runs ``--policy-steps`` like ``none``, after its 50 profiling
steps), the stall per
checkpoint (median; the first separately: it pays the slot's allocation), cfrun's
``snapshot_s`` and ``persist_s``, PGT, peak extra host memory (``max_rss`` of the training
process and its children minus the baseline's: the slots, DCP's staging; page cache is not
resident memory of a process), metadata bytes (checkpoint bytes on disk minus the state's), and
the load seconds. Physical limits measured at each size: one memcpy of the state into a reused
buffer, sequential write+fsync bandwidth, and read bandwidth of a file dropped from the page
cache.

Targets (issue 16), for ``cfrun`` at every size, PASS/FAIL: median stall <= 1.2 x memcpy; median
PGT <= 1.3 x bytes / write bandwidth + 50 ms (the better of buffered and ``O_DIRECT``
write+fsync, both measured); extra host memory <= 1.1 x state; load <= 1.3 x
bytes / read bandwidth; and for ``cfrun_policy``: overhead after the profile <= the budget.

Usage::

    .venv/bin/python bench/scaling.py                     # 0.1, 0.5, 2 GB (~15-20 min)
    .venv/bin/python bench/scaling.py --sizes 0.1         # smoke run (~2 min)
    .venv/bin/python bench/scaling.py --sizes 0.01 --steps 8 --contenders none,cfrun --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import checkpoint_overhead as co  # noqa: E402

TRAIN_SCRIPT = BENCH_DIR / "_scaling_train.py"
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_OUT = RESULTS_DIR / "scaling.json"
CONTENDERS = ["none", "torch_save", "dcp_thread", "dcp_process", "cfrun", "cfrun_policy"]
DIM = 128
BYTES_PER_PARAM = 12
"""fp32 parameter + Adam's exp_avg + exp_avg_sq."""
WARMUP_ITERS = 3
"""``_scaling_train.WARMUP_ITERS``."""
EXTRA_COPIES = {"none": 0.0, "torch_save": 0.0, "dcp_thread": 1.0, "dcp_process": 1.0,
                "cfrun": 1.0, "cfrun_policy": 1.0}
"""State copies a contender holds beyond the training process's own (for the memory guard)."""
PROCESS_FACTOR = 2.2
"""Training process's peak resident bytes per state byte, before one is measured (parameters,
the dense gradient, Adam's state and its temporaries)."""
BUDGET = 0.035
PROFILE_STEPS = 50
"""``cfrun.rank.probes.PROFILE_MAX_STEPS``: the policy's overhead is judged after them."""
CHILD_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
RUN_FIELDS = ["contender", "ok", "ms_per_iter", "overhead", "steady_overhead", "stall_s",
              "pgt_s", "snapshot_s", "persist_s", "n_checkpoints", "extra_host_bytes",
              "max_rss_bytes", "meta_bytes", "ckpt_bytes", "load_s", "interval"]
"""Fields every run record of the JSON has (None where a contender has no such figure)."""
SIZE_FIELDS = ["size_gb", "rows", "state_bytes", "limits", "runs", "skipped", "targets",
               "ratios"]
"""Fields every size record of the JSON has."""


def rows_for(size_gb):
    """Embedding rows whose state (params + Adam) is ``size_gb`` GB."""
    return max(64, round(size_gb * 1e9 / (BYTES_PER_PARAM * DIM)))


def env_for(contender):
    """Child environment: one OMP thread, passive waits, unbuffered; and ``PYTHONPATH`` so
    that the ``cfrun`` of this checkout is the one run. Python's bytecode cache is on, as it
    is for a user's installed packages (pip compiles them at install): a shell's
    ``PYTHONDONTWRITEBYTECODE=1`` made every cfrun process compile cfrun's modules again
    (0.2 s of cfrun's own start-up, more in each rank), a cost no installed cfrun pays."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(CHILD_ENV)
    root = str(BENCH_DIR.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def compile_cfrun():
    """Write the bytecode of this checkout's ``cfrun`` once (``compileall``), as ``pip
    install`` does, so that no contender's first run pays the compilation."""
    import compileall

    compileall.compile_dir(str(BENCH_DIR.parent / "cfrun"), quiet=1)


def measure_read(directory, nbytes, chunk_bytes=16 << 20):
    """Read bandwidth (bytes/s) of ``directory``'s disk: writes ``nbytes`` to a new file,
    fsyncs, drops it from the page cache (``posix_fadvise DONTNEED``), times reading it back
    in ``chunk_bytes`` reads into one reused buffer; the file is deleted."""
    path = os.path.join(directory, "read-probe.bin")
    chunk = os.urandom(1 << 20) * (chunk_bytes >> 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[:min(left, chunk_bytes)])
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    buf = bytearray(chunk_bytes)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    os.remove(path)
    return {"read_s": read_s, "bandwidth_bytes_per_s": nbytes / read_s}


def measure_write_direct(directory, nbytes, chunk_bytes=16 << 20):
    """Write+fsync bandwidth (bytes/s) with ``O_DIRECT`` (what cfrun's agent uses where the file
    system allows it): ``nbytes`` rounded up to 4 KiB from one page-aligned buffer in
    ``chunk_bytes`` writes to a new file, fsync; None where ``O_DIRECT`` is refused. The file is
    deleted."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return None
    path = os.path.join(directory, "direct-probe.bin")
    buf = mmap.mmap(-1, chunk_bytes)
    buf.write(os.urandom(1 << 20) * (chunk_bytes >> 20))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return None
    total = (nbytes + 4095) // 4096 * 4096
    try:
        t0 = time.perf_counter()
        left = total
        while left > 0:
            left -= os.write(fd, memoryview(buf)[:min(left, chunk_bytes)])
        os.fsync(fd)
        write_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(path)
        buf.close()
    return {"write_fsync_s": write_s, "bandwidth_bytes_per_s": total / write_s}


def write_bandwidth(limits):
    """The better of the buffered and the ``O_DIRECT`` write+fsync bandwidths (bytes/s): the
    PGT floor is set by the faster way to the disk."""
    direct = limits.get("disk_direct") or {}
    return max(limits["disk"]["bandwidth_bytes_per_s"], direct.get("bandwidth_bytes_per_s", 0))


def tree_bytes(path):
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def newest_ckpt_bytes(contender, ckpt_dir):
    """Bytes on disk of the newest checkpoint a contender wrote (a file or a directory)."""
    root = Path(ckpt_dir)
    if contender.startswith("cfrun"):
        from cfrun.contract.checkpoints import committed_steps
        from cfrun.contract.jobdir import JobDir, step_dir_name

        ckpts = JobDir(root).checkpoints
        steps = committed_steps(ckpts)
        return tree_bytes(ckpts / step_dir_name(steps[0])) if steps else None
    if contender == "torch_save":
        files = sorted(root.glob("step-*.pt"))
        return files[-1].stat().st_size if files else None
    dirs = sorted(p for p in root.glob("step-*") if p.is_dir())
    return tree_bytes(dirs[-1]) if dirs else None


def run_contender(contender, size_gb, rows, args, work_dir):
    """One training run of ``contender`` at ``rows``, then the load of its newest checkpoint
    in a fresh process; returns the run record (every field of :data:`RUN_FIELDS`). The run dir
    is deleted."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{contender}-{size_gb}-", dir=work_dir))
    k = args.interval
    steps = max(args.steps, args.policy_steps) if contender in ("none", "cfrun_policy") \
        else args.steps
    script = ["--contender", "cfrun" if contender.startswith("cfrun") else contender,
              "--k", str(k), "--steps", str(steps), "--rows", str(rows),
              "--dim", str(DIM)]
    ckpt_dir = run_dir / ("job" if contender.startswith("cfrun") else "ckpt")
    if contender == "cfrun":
        cmd = [sys.executable, "-m", "cfrun", "--interval", str(k), "--job-dir", str(ckpt_dir),
               "--max-restarts", "0", str(TRAIN_SCRIPT), *script]
    elif contender == "cfrun_policy":
        cmd = [sys.executable, "-m", "cfrun", "--overhead", f"{100 * BUDGET:g}%",
               "--job-dir", str(ckpt_dir), "--max-restarts", "0", str(TRAIN_SCRIPT), *script]
    else:
        cmd = [sys.executable, str(TRAIN_SCRIPT), *script]
        if contender != "none":
            cmd += ["--ckpt-dir", str(ckpt_dir)]
    rec = {f: None for f in RUN_FIELDS}
    rec.update(contender=contender, ok=False, cmd=shlex.join(cmd))
    try:
        t0 = time.perf_counter()
        prefix = co.slot_prefix_of(ckpt_dir) if contender.startswith("cfrun") else None
        proc, shm = co.run_sampling_shm(cmd, env_for(contender), run_dir, prefix)
        rec["wall_s"] = time.perf_counter() - t0
        if proc is None:
            rec["error"] = f"timed out after {co.RUN_TIMEOUT_S} s"
            return rec
        result = None
        for line in proc.stdout.splitlines():
            m = co.RESULT_RE.search(line)
            if m:
                result = json.loads(m.group(1))
        if proc.returncode != 0 or result is None:
            rec["error"] = f"exit {proc.returncode}" if proc.returncode else "no RESULT line"
            rec["stderr_tail"] = proc.stderr[-3000:]
            return rec
        rec["ms_per_iter"] = result["ms_per_iter"]
        rec["iter_ms"] = result["iter_ms"]
        rec["state_bytes"] = result["state_bytes"]
        rec["max_rss_bytes"] = result["max_rss_bytes"] + result["children_max_rss_bytes"]
        rec["shm"] = shm
        if contender.startswith("cfrun"):
            ev = co.read_cfrun_events(ckpt_dir, k, steps)
            for key in ("stall_s", "pgt_s", "snapshot_s", "persist_s", "ckpt_steps",
                        "notable_events"):
                rec[key] = ev.get(key)
            rec["n_checkpoints"] = ev["n_checkpoints"]
            decisions = [e for e in co_events(ckpt_dir) if e.get("event") == "decision"]
            rec["interval"] = decisions[-1]["interval"] if decisions else k
            rec["decision"] = decisions[-1] if decisions else None
            rec["leftover_slots"] = co.cfrun_leftover_slots(ckpt_dir)
        elif contender != "none":
            rec["stall_s"], rec["pgt_s"] = result["stall_s"], result["pgt_s"]
            rec["n_checkpoints"] = len(rec["stall_s"])
            rec["interval"] = k
        if contender != "none":
            rec["ckpt_bytes"] = newest_ckpt_bytes(contender, ckpt_dir)
            if rec["ckpt_bytes"] is not None:
                rec["meta_bytes"] = rec["ckpt_bytes"] - rec["state_bytes"]
                rec["load"] = time_load(contender, ckpt_dir, rows, args)
                rec["load_s"] = rec["load"].get("load_s")
        rec["ok"] = True
        return rec
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def co_events(job_dir):
    """Every event of a cfrun job dir's ``events.jsonl`` ([] without one)."""
    path = Path(job_dir) / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def time_load(contender, ckpt_dir, rows, args):
    """Run ``_scaling_train.py --load`` on ``ckpt_dir``; its RESULT dict (or ``error``)."""
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--load", "--contender",
           "cfrun" if contender.startswith("cfrun") else contender, "--ckpt-dir", str(ckpt_dir),
           "--rows", str(rows), "--dim", str(DIM)]
    try:
        p = subprocess.run(cmd, env=env_for(contender), capture_output=True, text=True,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"load timed out after {args.timeout} s"}
    for line in p.stdout.splitlines():
        m = co.RESULT_RE.search(line)
        if m:
            return json.loads(m.group(1))
    return {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-2000:]}


def steady(rec, base, first_step):
    """Mean iteration time from step ``first_step`` on against the baseline's same iterations,
    minus one (None when either is missing); ``first_step`` 0: the whole run."""
    if not (rec.get("iter_ms") and base and base.get("iter_ms")):
        return None
    lo = max(0, first_step - WARMUP_ITERS)
    a, b = rec["iter_ms"][lo:], base["iter_ms"][lo:len(rec["iter_ms"])]
    return statistics.fmean(a) / statistics.fmean(b) - 1.0 if a and b else None


def estimate_bytes(contender, state_bytes, rss_per_state):
    """Estimated peak host memory of a contender's run (training process + staged copies)."""
    return state_bytes * (rss_per_state + EXTRA_COPIES[contender])


def ratio(a, b):
    return None if a is None or b is None or not b else a / b


def check_targets(size):
    """Issue 16's targets at one size: a list of {target, passed (None: not run), detail}."""
    lim, runs, n = size["limits"], {r["contender"]: r for r in size["runs"]}, size["state_bytes"]
    c = runs.get("cfrun")
    out = []

    def add(name, value, limit, unit, scale=1.0):
        passed = None if value is None else value <= limit
        detail = ("not run" if value is None else
                  f"{value * scale:.3g} {unit} vs limit {limit * scale:.3g} {unit}")
        out.append({"target": name, "passed": passed, "detail": detail})

    memcpy_s = lim["memcpy"]["reused_buffer_s"]
    add("stall <= 1.2 x memcpy", c and co.median(c["stall_s"] or []), 1.2 * memcpy_s, "ms", 1e3)
    floor_w = n / write_bandwidth(lim)
    add("PGT <= 1.3 x bytes/write bw + 50 ms", c and co.median(c["pgt_s"] or []),
        1.3 * floor_w + 0.05, "ms", 1e3)
    add("extra host memory <= 1.1 x state", c and c.get("extra_host_bytes"), 1.1 * n, "GB", 1e-9)
    floor_r = n / lim["read"]["bandwidth_bytes_per_s"]
    add("load <= 1.3 x bytes/read bw", c and c.get("load_s"), 1.3 * floor_r, "s")
    p = runs.get("cfrun_policy")
    add(f"overhead under --overhead {100 * BUDGET:g}% (after its profile) <= budget",
        p and p.get("steady_overhead"), BUDGET, "%", 100)
    return out


def ratios(size):
    """The figures of cfrun's run over their physical limits."""
    lim, n = size["limits"], size["state_bytes"]
    c = next((r for r in size["runs"] if r["contender"] == "cfrun" and r["ok"]), None)
    if c is None:
        return {}
    return {
        "stall_over_memcpy": ratio(co.median(c["stall_s"] or []),
                                   lim["memcpy"]["reused_buffer_s"]),
        "pgt_over_write_floor": ratio(co.median(c["pgt_s"] or []), n / write_bandwidth(lim)),
        "persist_over_write_floor": ratio(co.median(c["persist_s"] or []),
                                          n / write_bandwidth(lim)),
        "extra_memory_over_state": ratio(c.get("extra_host_bytes"), n),
        "load_over_read_floor": ratio(c.get("load_s"), n / lim["read"]["bandwidth_bytes_per_s"]),
        "meta_over_state": ratio(c.get("meta_bytes"), n),
    }


def fmt(x, spec, scale=1.0):
    return "-" if x is None else format(x * scale, spec)


def print_size(size):
    """The table of one size, its limits, ratios and targets."""
    n, lim = size["state_bytes"], size["limits"]
    print(f"\n=== state {n / 1e9:.2f} GB ({size['rows']} rows x {DIM}, Adam) ===")
    hdr = ["contender", "k", "ms/iter", "ovh", "steady", "stall ms", "1st stall", "snap ms",
           "persist ms", "PGT ms", "ckpts", "extra GB", "xstate", "meta B", "load s"]
    body = []
    for r in size["runs"]:
        st = r.get("stall_s") or []
        body.append([r["contender"], fmt(r.get("interval"), "g"), fmt(r["ms_per_iter"], ".0f"),
                     fmt(r["overhead"], "+.1f", 100), fmt(r["steady_overhead"], "+.1f", 100),
                     fmt(co.median(st[1:] or st), ".1f", 1e3),
                     fmt(st[0] if st else None, ".0f", 1e3),
                     fmt(co.median(r.get("snapshot_s") or []), ".0f", 1e3),
                     fmt(co.median(r.get("persist_s") or []), ".0f", 1e3),
                     fmt(co.median(r.get("pgt_s") or []), ".0f", 1e3),
                     fmt(r["n_checkpoints"], "g"), fmt(r["extra_host_bytes"], ".2f", 1e-9),
                     fmt(ratio(r["extra_host_bytes"], n), ".2f"), fmt(r["meta_bytes"], ".0f"),
                     fmt(r["load_s"], ".2f")]
                    if r["ok"] else [r["contender"], "FAILED: " + str(r.get("error"))])
    widths = [max(len(h), *(len(b[i]) for b in body if len(b) > i)) for i, h in enumerate(hdr)]
    print("  ".join(h.rjust(w) for h, w in zip(hdr, widths)))
    for b in body:
        print("  ".join(x.rjust(w) for x, w in zip(b, widths)) if len(b) == len(hdr)
              else "  ".join(b))
    for s in size["skipped"]:
        print(f"skipped {s['contender']}: {s['reason']}")
    mc, dk, rd = lim["memcpy"], lim["disk"], lim["read"]
    print(f"limits: memcpy {1e3 * mc['reused_buffer_s']:.0f} ms (fresh memory "
          f"{1e3 * mc['fresh_alloc_s']:.0f} ms); write+fsync buffered "
          f"{dk['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, O_DIRECT "
          f"{fmt((lim.get('disk_direct') or {}).get('bandwidth_bytes_per_s'), '.2f', 1e-9)} GB/s"
          f" -> floor {n / write_bandwidth(lim):.2f} s; "
          f"read {rd['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s -> floor "
          f"{n / rd['bandwidth_bytes_per_s']:.2f} s")
    print("cfrun ratios: " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in size["ratios"].items()))
    for t in size["targets"]:
        word = "n/a " if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"  {word}  {t['target']}: {t['detail']}")


def run_size(size_gb, args, work_dir, rss_per_state):
    """Every contender at one size, one after another; returns the size record."""
    rows = rows_for(size_gb)
    state_bytes = rows * DIM * BYTES_PER_PARAM + (DIM + 1) * BYTES_PER_PARAM
    size = {"size_gb": size_gb, "rows": rows, "state_bytes": state_bytes, "runs": [],
            "skipped": []}
    print(f"[{size_gb} GB] measuring limits...", flush=True)
    co.torch.set_num_threads(1)
    size["limits"] = {"memcpy": co.measure_memcpy(state_bytes, repeats=3),
                      "disk": co.measure_disk(work_dir, state_bytes, repeats=2),
                      "disk_direct": measure_write_direct(work_dir, state_bytes),
                      "read": measure_read(work_dir, state_bytes)}
    base = None
    for c in args.contenders:
        need = estimate_bytes(c, state_bytes, rss_per_state)
        if need > args.mem_limit_gb * 2**30:
            reason = (f"needs ~{need / 2**30:.1f} GiB of host memory (process "
                      f"{rss_per_state:.2f} x state + {EXTRA_COPIES[c]:g} staged copies), over "
                      f"--mem-limit-gb {args.mem_limit_gb:g}")
            print(f"[{size_gb} GB] skip {c}: {reason}", flush=True)
            size["skipped"].append({"contender": c, "reason": reason})
            continue
        if c == "dcp_process" and not args.dcp_process:
            size["skipped"].append({"contender": c, "reason": args.dcp_note})
            continue
        rec = run_contender(c, size_gb, rows, args, work_dir)
        if c == "none" and rec["ok"]:
            base = rec
            rss_per_state = rec["max_rss_bytes"] / state_bytes
        if rec["ok"] and base is not None and c != "none":
            rec["overhead"] = steady(rec, base, 0)
            first = PROFILE_STEPS + 5 if c == "cfrun_policy" else \
                (rec.get("interval") or args.interval) + 1
            rec["steady_overhead"] = steady(rec, base, first)
            rec["extra_host_bytes"] = max(0, rec["max_rss_bytes"] - base["max_rss_bytes"])
        size["runs"].append(rec)
        print(f"[{size_gb} GB] {c:<12} " + (
            f"{rec['ms_per_iter']:.0f} ms/iter, {rec['n_checkpoints'] or 0} ckpts, "
            f"load {fmt(rec['load_s'], '.2f')} s ({rec['wall_s']:.0f} s)" if rec["ok"] else
            f"FAILED: {rec.get('error')} {rec.get('stderr_tail', '')[-600:]}"), flush=True)
    size["targets"] = check_targets(size)
    size["ratios"] = ratios(size)
    return size, rss_per_state


def main(argv=None):
    """Parse options, run every size, print the tables and targets, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.1,0.5,2", help="state sizes in GB, comma separated")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--interval", type=int, default=5, help="the fixed checkpoint interval k")
    ap.add_argument("--policy-steps", type=int, default=100,
                    help="steps of the cfrun_policy run and of the baseline (the policy "
                         f"profiles during the first {PROFILE_STEPS})")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma-separated subset (none is always run first)")
    ap.add_argument("--mem-limit-gb", type=float, default=12.0,
                    help="skip a contender whose estimated peak host memory exceeds this (GiB)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file for the raw numbers")
    ap.add_argument("--tmp-root", default=str(RESULTS_DIR / "tmp"),
                    help="where run dirs are created (the disk that is measured)")
    args = ap.parse_args(argv)
    wanted = [c for c in args.contenders.split(",") if c]
    bad = [c for c in wanted if c not in CONTENDERS]
    if bad:
        ap.error(f"unknown contender(s) {bad}; choose from {CONTENDERS}")
    args.contenders = ["none"] + [c for c in CONTENDERS[1:] if c in wanted]
    co.RUN_TIMEOUT_S = args.timeout
    args.dcp_process, args.dcp_note = co.dcp_process_available()
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    Path(args.tmp_root).mkdir(parents=True, exist_ok=True)
    work_dir = tempfile.mkdtemp(prefix="scaling-", dir=args.tmp_root)
    sizes, rss_per_state = [], PROCESS_FACTOR
    t0 = time.perf_counter()
    try:
        for s in [float(x) for x in args.sizes.split(",") if x.strip()]:
            size, rss_per_state = run_size(s, args, work_dir, rss_per_state)
            sizes.append(size)
            print_size(size)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(f"\ncommand: {command}\ntotal {(time.perf_counter() - t0) / 60:.1f} min; "
          f"torch {co.torch.__version__}; {os.cpu_count()} CPUs; {args.steps} steps per run, "
          f"k={args.interval}; one run per contender and size")
    for size in sizes:
        for t in size["targets"]:
            word = "n/a " if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
            print(f"{size['size_gb']:>5g} GB  {word}  {t['target']}: {t['detail']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "steps": args.steps,
                               "interval": args.interval, "torch": co.torch.__version__,
                               "sizes": sizes}, indent=1))
    print(f"raw numbers: {out}")


if __name__ == "__main__":
    main()
