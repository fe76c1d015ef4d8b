"""Time to recover: from a rank's SIGKILL to its first optimizer step after cfrun's resume.

What is measured
----------------
``bench/_recovery_train.py`` (``_overhead_train.py``'s MLP with Adam, ~126 MB of state, one
thread per rank; DDP over gloo for 2 ranks) runs under ``cfrun --interval K`` with 1 and with 2
ranks. Once a checkpoint is committed and the script is a few steps past it, the driver
SIGKILLs one rank (rank 0's process for 1 rank, the last rank for 2) and waits for the script's
first optimizer step after the kill (rank 0 stamps every step with the unix time into a file).
That is the *time to recover*, broken down from the job's events and the kill time:

* ``detect``: kill -> ``attempt_end`` (torchrun notices the dead rank, stops the others and
  exits; cfrun's supervisor reaps it);
* ``backoff``: ``attempt_end`` -> next ``attempt_start`` (the restart decision and its wait);
* ``launch``: ``attempt_start`` -> the rank process's creation (torchrun's start and
  rendezvous);
* ``import``: rank process creation -> cfrun's hooks installed (interpreter, torch, cfrun);
* ``agent_wait``: the rank waiting for the persist agent to finish the killed attempt's
  hand-off (``agent_wait_s`` of ``resumed``);
* ``read``: what cfrun's reading and verifying of the checkpoint held the script: at install
  (``read_sync_s`` of ``resumed``: choosing the checkpoint, the JSON) plus the wait for the
  background read at the resume point (``read_wait_s``); for a cfrun without the background
  read (issue 23, item 5), all of ``read_s``;
* ``to_boundary``: the script's own start-up to the loop head where the state is restored
  (imports, model and optimizer construction, DDP set-up, fast-forward), less that wait;
* ``restore``: putting the state into the live objects (``restore_s`` of ``resumed``);
* ``first_step``: ``resumed`` -> the first optimizer step's stamp.

The *plain start-up* (measured before each kill, interleaved) is the same script without cfrun (``python SCRIPT`` for 1 rank,
``torchrun --standalone --nproc-per-node 2 SCRIPT`` for 2): from the launch to its first step.
The *read floor* is the state's bytes over the disk's read bandwidth (a file dropped from the
page cache, ``bench/scaling.measure_read``).

Target (issue 23, item 5): recover <= plain start-up + 1 s, for 1 and 2 ranks: the checkpoint
is read while the script starts up (from the page cache after a kill: the file was just
written). The read floor is printed for reference (issue 16's target added it).

Usage::

    .venv/bin/python bench/recovery.py                  # 3 kills each for 1 and 2 ranks (~5 min)
    .venv/bin/python bench/recovery.py --repeats 1 --ranks 1
    # the default on one node (cfrun starts the ranks, a warm spare per rank), 1 and 2 ranks,
    # against a cold restart and torchrun's start-up (issue 35)
    .venv/bin/python bench/recovery.py --warm
    # the warm torchrun of a torchrun job (1 and 2 ranks) against a cold restart and torchrun
    .venv/bin/python bench/recovery.py --warm --cfrun-args '--launcher torchrun'
    # every process of the job SIGKILLed at once, then the same command (issue 35)
    .venv/bin/python bench/recovery.py --whole-tree --repeats 1
    # ~1 GB of state, 3 s of start-up; before/after: the same with --cfrun-root /work/main
    .venv/bin/python bench/recovery.py --repeats 1 --ranks 1 --hidden 6500 --startup-s 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import scaling  # noqa: E402

TRAIN_SCRIPT = BENCH_DIR / "_recovery_train.py"
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_OUT = RESULTS_DIR / "recovery.json"
PHASES = ["detect", "backoff", "launch", "import", "agent_wait", "read", "to_boundary", "restore",
          "first_step"]
"""The breakdown's parts, in order; they add up to the time to recover."""
EXTRA = ["read_bg"]
"""Shown beside the breakdown, not part of it: ``read_bg``, the whole read (``read_s``),
in the background from ``read_sync_s`` on, overlapping ``to_boundary``."""
SLACK_S = 1.0


def read_stamps(path):
    """(step, unix time) pairs of the stamps file ([] before the first)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((int(parts[0]), float(parts[1])))
    return out


def wait_for(cond, timeout_s, what, period_s=0.05):
    """Poll ``cond()`` until it returns something truthy; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(period_s)
    raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")


def rank_pids(root_pid):
    """Pids of the processes under ``root_pid`` that run the training script itself (the ranks),
    sorted by their RANK (from their environment, else pid order)."""
    import psutil

    out = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = p.cmdline()
            # python [-u] SCRIPT (torchrun adds -u; a process cfrun or torchrun forked and has
            # not exec'd yet shows their command line, which names the script too)
            if [c for c in cmd[1:3] if c != "-u"][:1] == [str(TRAIN_SCRIPT)]:
                out.append((int(p.environ().get("RANK", "0")), p.pid))
        except psutil.Error:
            continue
    return [pid for _, pid in sorted(out)]


def stop(proc, grace_s=30.0):
    """SIGTERM ``proc`` (cfrun stops its job), SIGKILL after ``grace_s``; reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def work_args(args):
    """The training script's options that set its work: state size and start-up."""
    return ["--hidden", str(args.hidden), "--startup-s", str(args.startup_s)]


def plain_startup(ranks, work, timeout_s, args, torchrun=False):
    """Seconds from launching the plain script (no cfrun) to its first optimizer step: ``python
    SCRIPT`` for one rank (``torchrun --standalone --nproc-per-node 1`` with ``torchrun``),
    torchrun for several."""
    stamps = Path(tempfile.mkdtemp(dir=work)) / "stamps"
    script = [str(TRAIN_SCRIPT), "--stamps", str(stamps), "--steps", "3", *work_args(args)]
    cmd = ([sys.executable, *script] if ranks == 1 and not torchrun else
           [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", *script])
    t0 = time.time()
    p = subprocess.Popen(cmd, env=scaling.env_for("plain"), cwd=work,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = wait_for(lambda: read_stamps(stamps), timeout_s, "the plain script's first step")
        p.wait(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return first[0][1] - t0


def events(job_dir):
    return scaling.co_events(job_dir)


def one_kill(ranks, args, work, warm=False):
    """One cfrun run: wait for a commit, SIGKILL a rank, wait for the first step after the
    resume; returns the breakdown (seconds per phase of :data:`PHASES`) and raw times.
    ``warm``: with its warm spare (``CFRUN_STANDBY=1``: the next rank where cfrun starts the
    ranks, the default on one node; the next torchrun under ``--launcher torchrun``), the kill once the spare said it is ready
    (``standby_ready``), as in a job that failed hours in; else ``CFRUN_STANDBY=0`` (every
    restart cold)."""
    run = Path(tempfile.mkdtemp(prefix=f"r{ranks}-", dir=work))
    job, stamps = run / "job", run / "stamps"
    more = shlex.split(args.cfrun_args)
    cmd = [sys.executable, "-m", "cfrun", "--interval", str(args.interval), "--job-dir",
           str(job), "--max-restarts", "3", "--nproc-per-node", str(ranks),
           *more, str(TRAIN_SCRIPT), "--stamps", str(stamps), *work_args(args)]
    out = open(run / "cfrun.log", "w")
    env = {**scaling.env_for("cfrun"), "CFRUN_STANDBY": "1" if warm else "0"}
    if args.cfrun_root:  # another checkout's cfrun (e.g. main's, for a before/after)
        env["PYTHONPATH"] = args.cfrun_root
    p = subprocess.Popen(cmd, env=env, cwd=run, stdout=out, stderr=out)
    rec = {"ranks": ranks, "cmd": shlex.join(cmd)}
    try:
        commit = wait_for(lambda: [e for e in events(job) if e.get("event") == "commit"],
                          args.timeout, "the first commit")[0]
        step0 = commit["step"]
        wait_for(lambda: any(s >= step0 + 3 for s, _ in read_stamps(stamps)), args.timeout,
                 "3 steps past the commit")
        if warm:  # every spare: one per rank where cfrun starts the ranks
            spares = 1 if launcher_of(more) == "torchrun" else ranks
            wait_for(lambda: len([e for e in events(job) if e.get("event") == "standby_ready"])
                     >= spares, args.timeout, "the warm spares")
        victim = rank_pids(p.pid)[-1]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        # the first step of the next attempt: a surviving rank 0 may still stamp the step it
        # was in when its peer died (the all-reduce had finished), after the kill
        start = wait_for(lambda: [e for e in events(job) if e.get("event") == "attempt_start"
                                  and e["attempt"] == 1], args.timeout, "the restart")[0]
        first = wait_for(lambda: [t for _, t in read_stamps(stamps)
                                  if t > max(t_kill, start["t_unix_s"])],
                         args.timeout, "the first step after the resume")[0]
        resumed = wait_for(lambda: [e for e in events(job) if e.get("event") == "resumed"
                                    and e.get("rank") == 0], args.timeout, "resumed")[-1]
        ev = events(job)
        end = next(e for e in ev if e.get("event") == "attempt_end" and e["attempt"] == 0)
        rec.update(t_kill=t_kill, t_first_step=first, recover_s=first - t_kill,
                   resumed=resumed, resumed_step=resumed.get("step"))
        rec["phases"] = breakdown(t_kill, end, start, resumed, first)
    finally:
        stop(p)
        out.close()
        rec["log_tail"] = (run / "cfrun.log").read_text()[-1500:]
        shutil.rmtree(run, ignore_errors=True)
    return rec


def launcher_of(cfrun_args):
    """The launcher the cfrun options ``cfrun_args`` (a list) run the bench's one-node job
    with: the ``--launcher`` they give, else ``local`` (``auto``'s choice on one node:
    cfrun starts the ranks itself, a warm spare per rank)."""
    joined = " ".join(cfrun_args).replace("=", " ").split()
    given = [b for a, b in zip(joined, joined[1:]) if a == "--launcher"]
    return "local" if not given or given[-1] == "auto" else given[-1]


def tree_kill(ranks, args, work):
    """One lost node without losing its disk: a cfrun run, every process of its tree SIGKILLed
    at once (cfrun, its reaper and agent, torchrun, the ranks: nothing warm is left), then the
    same command again, as a scheduler would; returns the time from that relaunch to the
    first optimizer step and its breakdown (``detect`` None; ``backoff``: cfrun's own start,
    the relaunch to its ``attempt_start``). Issue 35's bound: <= the plain start-up + the
    read."""
    import psutil

    run = Path(tempfile.mkdtemp(prefix=f"t{ranks}-", dir=work))
    job, stamps = run / "job", run / "stamps"
    cmd = [sys.executable, "-m", "cfrun", "--interval", str(args.interval), "--job-dir",
           str(job), "--max-restarts", "3", "--nproc-per-node", str(ranks),
           *shlex.split(args.cfrun_args), str(TRAIN_SCRIPT), "--stamps", str(stamps),
           *work_args(args)]
    out = open(run / "cfrun.log", "w")
    env = {**scaling.env_for("cfrun"), "CFRUN_STANDBY": "0"}
    if args.cfrun_root:
        env["PYTHONPATH"] = args.cfrun_root
    p = subprocess.Popen(cmd, env=env, cwd=run, stdout=out, stderr=out)
    again = None
    rec = {"ranks": ranks, "cmd": shlex.join(cmd)}
    try:
        commit = wait_for(lambda: [e for e in events(job) if e.get("event") == "commit"],
                          args.timeout, "the first commit")[0]
        wait_for(lambda: any(s >= commit["step"] + 3 for s, _ in read_stamps(stamps)),
                 args.timeout, "3 steps past the commit")
        tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        for proc in tree:
            try:
                proc.kill()
            except psutil.Error:
                pass
        p.wait()
        psutil.wait_procs(tree, timeout=10)
        t_launch = time.time()
        again = subprocess.Popen(cmd, env=env, cwd=run, stdout=out, stderr=out)
        first = wait_for(lambda: [t for _, t in read_stamps(stamps) if t > t_launch],
                         args.timeout, "the first step after the relaunch")[0]
        resumed = wait_for(lambda: [e for e in events(job) if e.get("event") == "resumed"
                                    and e.get("rank") == 0], args.timeout, "resumed")[-1]
        start = [e for e in events(job) if e.get("event") == "attempt_start"][-1]
        rec.update(t_kill=t_launch, t_first_step=first, recover_s=first - t_launch,
                   resumed=resumed, resumed_step=resumed.get("step"))
        rec["phases"] = {**breakdown(t_launch, {"t_unix_s": t_launch}, start, resumed, first),
                         "detect": None}
    finally:
        for proc in (p, again):
            if proc is not None:
                stop(proc)
        out.close()
        rec["log_tail"] = (run / "cfrun.log").read_text()[-1500:]
        shutil.rmtree(run, ignore_errors=True)
    return rec


def breakdown(t_kill, end, start, resumed, t_first):
    """Seconds per phase (:data:`PHASES`) from the kill time, the supervisor's events of the
    two attempts, rank 0's ``resumed`` event and the first step's stamp; a phase whose
    timestamps the event lacks (an older cfrun) is None."""
    proc0 = resumed.get("process_start_unix_s")
    read0 = resumed.get("read_start_unix_s")
    read_s = resumed.get("read_s")
    agent_s = resumed.get("agent_wait_s")
    restore_s = resumed.get("restore_s")
    t_res = resumed["t_unix_s"]

    def d(a, b):
        return None if a is None or b is None else b - a

    sync_s, wait_s = resumed.get("read_sync_s", read_s), resumed.get("read_wait_s", 0.0)
    held_s = None if sync_s is None else sync_s + (wait_s or 0.0)
    install_end = None if read0 is None or sync_s is None else read0 + sync_s
    restore0 = None if restore_s is None else t_res - restore_s
    boundary = d(install_end, restore0)
    return {"detect": d(t_kill, end["t_unix_s"]), "backoff": d(end["t_unix_s"], start["t_unix_s"]),
            "launch": d(start["t_unix_s"], proc0),
            "import": d(proc0, None if read0 is None else read0 - (agent_s or 0.0)),
            "agent_wait": agent_s, "read": held_s,
            "to_boundary": None if boundary is None else boundary - (wait_s or 0.0),
            "restore": restore_s, "first_step": d(t_res, t_first), "read_bg": read_s}


def main(argv=None):
    """Measure the plain start-up and the time to recover for each rank count; print, save."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2", help="rank counts, comma separated")
    ap.add_argument("--repeats", type=int, default=3, help="kills per rank count")
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=180, help="seconds per wait")
    ap.add_argument("--cfrun-args", default="",
                    help="more cfrun options, e.g. '--launcher torchrun' (the default on one "
                         "node: cfrun starts the ranks itself)")
    ap.add_argument("--hidden", type=int, default=2048,
                    help="the MLP's width: ~24 * hidden**2 bytes of state (2048: ~126 MB; "
                         "6500: ~1 GB)")
    ap.add_argument("--startup-s", type=float, default=0.0,
                    help="the script sleeps this long before building its model (a large job's "
                         "start-up: CUDA initialisation, model construction)")
    ap.add_argument("--cfrun-root", default="",
                    help="run the cfrun of this checkout instead (PYTHONPATH), e.g. /work/main "
                         "for a before/after comparison")
    ap.add_argument("--warm", action="store_true",
                    help="also a job with its warm spare (the next rank where cfrun starts the "
                         "ranks, the next torchrun under --launcher torchrun), killed "
                         "once the spare is ready, against torchrun's plain start-up")
    ap.add_argument("--whole-tree", action="store_true",
                    help="also SIGKILL every process of the job at once (a lost node whose "
                         "disk survives) and relaunch the same command: relaunch to first "
                         "step against the plain start-up + the read floor")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--tmp-root", default=str(RESULTS_DIR / "tmp"))
    args = ap.parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv])
    print(f"command: {command}", flush=True)
    Path(args.tmp_root).mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="recovery-", dir=args.tmp_root)
    results = []
    try:
        sys.path.insert(0, str(BENCH_DIR))
        h = args.hidden  # parameters of the MLP (bench/_overhead_train.py) and Adam's two
        state_bytes = 4 * 3 * (2 * h * h + 1037 * h + 10)
        scaling.compile_cfrun()
        read = scaling.measure_read(work, state_bytes)
        floor_s = state_bytes / read["bandwidth_bytes_per_s"]
        for ranks in [int(x) for x in args.ranks.split(",") if x]:
            plain, kills, torchrun, warm, trees = [], [], [], [], []
            for i in range(args.repeats):  # interleaved: a slow phase of the machine hits all
                plain.append(plain_startup(ranks, work, args.timeout, args))
                rec = one_kill(ranks, args, work)
                kills.append(rec)
                print(f"[{ranks} rank(s)] plain start-up {plain[-1]:.2f} s; kill {i + 1}: "
                      f"recovered in {rec['recover_s']:.2f} s "
                      + " ".join(f"{k}={fmt(v)}" for k, v in rec["phases"].items()), flush=True)
                if args.warm or args.whole_tree:
                    torchrun.append(plain_startup(ranks, work, args.timeout, args,
                                                  torchrun=True))
                if args.warm:
                    warm.append(one_kill(ranks, args, work, warm=True))
                    print(f"[{ranks} rank(s), warm spare] plain torchrun start-up "
                          f"{torchrun[-1]:.2f} s; "
                          f"kill {i + 1}: recovered in {warm[-1]['recover_s']:.2f} s "
                          + " ".join(f"{k}={fmt(v)}" for k, v in warm[-1]["phases"].items()),
                          flush=True)
                if args.whole_tree:
                    trees.append(tree_kill(ranks, args, work))
                    print(f"[{ranks} rank(s), whole tree] relaunch to first step "
                          f"{trees[-1]['recover_s']:.2f} s "
                          + " ".join(f"{k}={fmt(v)}" for k, v in trees[-1]["phases"].items()),
                          flush=True)
            results.append({"ranks": ranks, "plain_startup_s": plain, "kills": kills})
            if trees:  # against the plain start-up of the launcher the job used
                results.append({"ranks": f"{ranks} tree", "kills": trees,
                                "plain_startup_s": plain if launcher_of(
                                    shlex.split(args.cfrun_args)) == "python" else torchrun,
                                "limit_extra_s": floor_s, "plain_python_startup_s": plain,
                                "plain_torchrun_startup_s": torchrun})
            if warm:
                results.append({"ranks": f"{ranks} warm", "plain_startup_s": plain, "kills": warm,
                                "plain_torchrun_startup_s": torchrun})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ncommand: {command}")
    print(f"state {state_bytes / 1e6:.0f} MB; read {read['bandwidth_bytes_per_s'] / 1e9:.2f} "
          f"GB/s -> read floor {floor_s:.2f} s; medians over {args.repeats} kill(s)")
    hdr = ["ranks", "plain start", "recover", *PHASES, *EXTRA, "target", ""]
    print("  ".join(f"{h:>11}" for h in hdr))
    summary = []
    for r in results:
        plain = statistics.median(r["plain_startup_s"])
        rec = statistics.median(k["recover_s"] for k in r["kills"])
        phases = {ph: med([k["phases"].get(ph) for k in r["kills"]]) for ph in PHASES + EXTRA}
        limit = plain + r.get("limit_extra_s", SLACK_S)  # a whole-tree kill: + the read
        ok = rec <= limit
        summary.append({"ranks": r["ranks"], "plain_startup_s": plain, "recover_s": rec,
                        "phases": phases, "limit_s": limit, "passed": ok})
        print("  ".join(f"{x:>11}" for x in [str(r["ranks"]), fmt(plain), fmt(rec),
                                              *(fmt(phases[ph]) for ph in PHASES + EXTRA),
                                              fmt(limit),
                                              "PASS" if ok else "FAIL"]))
    for s, r in zip(summary, results):
        extra = "the read floor" if "limit_extra_s" in r else f"{SLACK_S:g} s"
        print(f"{s['ranks']} rank(s): {'PASS' if s['passed'] else 'FAIL'}  recover "
              f"{s['recover_s']:.2f} s <= plain start-up {s['plain_startup_s']:.2f} s + "
              f"{extra} = {s['limit_s']:.2f} s")
        if "limit_extra_s" in r:  # the whole tree: against both plain start-ups
            for name in ("python", "torchrun"):
                t = statistics.median(r[f"plain_{name}_startup_s"])
                s[f"plain_{name}_startup_s"] = t
                print(f"{s['ranks']}: relaunch / plain {name} start-up = "
                      f"{s['recover_s']:.2f} / {t:.2f} = {s['recover_s'] / t:.2f}x")
        elif r.get("plain_torchrun_startup_s"):  # issue 35: <= 0.5x torchrun's start-up
            t = statistics.median(r["plain_torchrun_startup_s"])
            s["plain_torchrun_startup_s"] = t
            s["ratio_to_torchrun"] = s["recover_s"] / t
            print(f"{s['ranks']}: recover / plain torchrun start-up = {s['recover_s']:.2f} / "
                  f"{t:.2f} = {s['recover_s'] / t:.2f}x (target <= 0.5x): "
                  f"{'PASS' if s['recover_s'] <= 0.5 * t else 'FAIL'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "state_bytes": state_bytes, "read": read,
                               "read_floor_s": floor_s, "summary": summary,
                               "runs": results}, indent=1))
    print(f"raw numbers: {out}")


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x):
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
