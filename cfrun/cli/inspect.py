"""Read-only views of a job dir for ``cfrun status``, ``cfrun ls`` and ``cfrun export``.

Everything here reads files written by the supervisor, the ranks and the agent
(``config.json``, ``events.jsonl``, ``checkpoints/``, heartbeats); nothing is modified, so the
commands are safe on a live job. Checkpoints are loaded only after their checksums verify.

The job dir may have been edited by someone else (a copied or downloaded job dir, another
user): only names the format allows are read (``config.json``, ``events.jsonl``, heartbeats,
``manifest.json`` and the ``rank-NNNNN.bin|json`` files a manifest lists), each only if it is a
regular file (not a FIFO, a device or a symlink) of a bounded size, checked with ``fstat`` on
the open file before reading. ``status`` and ``ls`` never import torch; ``export`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO

from cfrun.contract import coordination as co
from cfrun.contract import gpus, progress
from cfrun.contract.checkpoints import committed_steps, read_manifest, verify
from cfrun.contract.config import resume_command
from cfrun.contract.errors import BadInputError, CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.events import OVERHEAD_DEFINITION, overhead_seconds
from cfrun.contract.fsio import UnsafeFileError, open_regular, read_regular, tree_bytes
from cfrun.contract.goodput import goodput
from cfrun.contract.jobdir import JobDir, step_dir_name

MAX_CONFIG_BYTES = 16 << 20
"""Largest ``config.json``/``strategy.json`` read."""
MAX_EVENTS_BYTES = 512 << 20
"""Largest ``events.jsonl`` read by ``cfrun status``."""


def _read_small(path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes (not a link, FIFO or device; at most ``max_bytes``).

    Raises:
        BadInputError: anything else, naming the file.
    """
    try:
        return bytes(read_regular(path, max_bytes=max_bytes))
    except UnsafeFileError as e:
        raise BadInputError(f"{str(path)!r} is refused: {e}; restore it from the run's "
                            "own files") from None
    except OSError as e:
        raise BadInputError(f"{str(path)!r} is unreadable ({e.strerror or e})") from None


def check_regular(path: Path, max_bytes: int) -> None:
    """Refuse ``path`` unless it is missing or a regular file of at most ``max_bytes``, without
    reading it (``cfrun status --metrics`` then reads it in parts).

    Raises:
        BadInputError: a link, FIFO, device or directory, too big, or unreadable, naming it.
    """
    if not os.path.lexists(path):
        return
    try:
        fd, _ = open_regular(path, max_bytes=max_bytes)
    except UnsafeFileError as e:
        raise BadInputError(f"{str(path)!r} is refused: {e}; restore it from the run's "
                            "own files") from None
    except OSError as e:
        raise BadInputError(f"{str(path)!r} is unreadable ({e.strerror or e})") from None
    os.close(fd)


def _read_json(path: Path, max_bytes: int) -> dict[str, Any]:
    """A JSON object from a regular file (see :func:`_read_small`).

    Raises:
        BadInputError: not a regular file, too big, not a JSON object.
    """
    try:
        obj = json.loads(_read_small(path, max_bytes))
    except ValueError as e:
        raise BadInputError(f"{str(path)!r} is unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise BadInputError(f"{str(path)!r} is unreadable (not a JSON object)")
    return obj


def read_events(jd: JobDir) -> list[dict[str, Any]]:
    """``events.jsonl`` as :meth:`JobDir.read_events` reads it, from a regular file only."""
    if not os.path.lexists(jd.events_path):
        return []
    out = []
    for line in _read_small(jd.events_path, MAX_EVENTS_BYTES).splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def open_job_dir(path: str) -> JobDir:
    """A job dir that exists and has ``config.json``.

    Raises:
        BadInputError: missing, or not a cfrun job dir.
    """
    jd = JobDir(Path(path).expanduser())
    if not jd.root.is_dir():
        raise BadInputError(f"job dir {path!r} does not exist; give the --job-dir of a run "
                            "(default ./cfrun-jobs/<script name>-<hash>)")
    if not jd.config_path.is_file():
        raise BadInputError(f"{path!r} is not a cfrun job dir (no config.json)")
    return jd


JOBS_DIR = "cfrun-jobs"
"""The directory of default job dirs under the working directory
(:func:`cfrun.contract.config.default_job_dir`)."""


def jobs_under(root: Path) -> list[JobDir]:
    """The job dirs directly inside ``root`` (those with ``config.json``), by name."""
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []
    return [JobDir(p) for p in children if JobDir(p).config_path.is_file()]


def _recorded_script(jd: JobDir) -> str | None:
    """The script path ``config.json`` records; None where it is unreadable."""
    try:
        script = _read_json(jd.config_path, MAX_CONFIG_BYTES).get("script")
    except BadInputError:
        return None
    return script if isinstance(script, str) else None


def find_jobs(path: str | None, cwd: Path) -> JobDir | list[JobDir]:
    """What ``cfrun status [PATH]`` shows (issue 27, item 4): one job dir, or the job dirs to
    list one line each. ``PATH`` is a job dir; a directory of job dirs (``cfrun-jobs``); a
    script, whose job dirs are those of ``./cfrun-jobs`` whose ``config.json`` records that
    script (its default job dir hashes its arguments and world size too, so a bare path may
    match several); none: ``./cfrun-jobs`` (or ``cwd`` itself when it is a job dir).

    Raises:
        BadInputError: nothing there, or no job found, naming what to give instead.
    """
    if path is None:
        if JobDir(cwd).config_path.is_file():
            return JobDir(cwd)
        path = JOBS_DIR
        if not (cwd / path).is_dir():
            raise BadInputError(f"no ./{JOBS_DIR} here ({cwd}); give a job dir, e.g. cfrun "
                                f"status {JOBS_DIR}/train-1a2b3c4d, or run cfrun status where "
                                "the job was started")
    p = (cwd / Path(path).expanduser())
    if p.is_file():
        script = str(p.resolve())
        jobs = [jd for jd in jobs_under(cwd / JOBS_DIR) if _recorded_script(jd) == script]
        if not jobs:
            raise BadInputError(f"no job of {path!r} in ./{JOBS_DIR}; give the --job-dir it ran "
                                "with, or run cfrun status where it was started")
        return jobs[0] if len(jobs) == 1 else jobs
    if p.is_dir() and not JobDir(p).config_path.is_file():
        jobs = jobs_under(p)
        if not jobs:
            raise BadInputError(f"{path!r} is not a cfrun job dir (no config.json) and holds "
                                "none; give the --job-dir of a run")
        return jobs
    return open_job_dir(path)


def summary(jd: JobDir, config: dict[str, Any] | None = None,
            events: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A job's one-line facts (``cfrun status`` and ``cfrun ls`` of several jobs, and the head
    of :func:`status`): job_dir, script, module (``-m MODULE``; None: a script file), command
    (:func:`command_text`), state, is_running, current_step, total_steps (the step the run
    ends at: ``--total-steps``, else the epoch loop's length, :mod:`cfrun.contract.progress`;
    None where unknown), steps_per_s and eta_s (seconds left; both None unless the job runs
    and they are known), last_committed_step, resume_command (the ``cfrun resume`` line that
    goes on with a stopped, failed, fatal, preempted or dead job; None while it runs or after
    it succeeded)."""
    config = _read_json(jd.config_path, MAX_CONFIG_BYTES) if config is None else config
    events = read_events(jd) if events is None else events
    states = [e for e in events if e.get("event") == "state"]
    running, state = _liveness(jd, config, states[-1]["state"] if states else None)
    node = config.get("node_rank")
    module = config.get("module")
    beat = co.newest_heartbeat(jd.root)
    step = beat[0] if beat is not None else None
    total = progress.total_steps(config.get("total_steps"), events)
    rate = progress.steps_per_s(events, step, beat[1]) if running and beat else None
    return {"job_dir": str(jd.root), "script": config.get("script"),
            "module": module if isinstance(module, str) else None,
            "command": command_text(config), "state": state,
            "is_running": running, "current_step": step, "total_steps": total,
            "steps_per_s": None if rate is None else round(rate, 4),
            "eta_s": _round(progress.eta_s(step, total, rate)),
            "last_committed_step": _newest_readable(jd),
            "resume_command": None if running or state == "succeeded"
            else resume_command(jd.root, node if isinstance(node, int) else 0)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def command_text(config: dict[str, Any]) -> str:
    """The job's script and arguments as a shell would show them, the script by its file name
    (``train.py --lr 0.1``, ``-m pkg.train --lr 0.1``): what tells jobs of one script apart
    in a list of jobs. ``?`` where ``config.json`` does not say."""
    import shlex

    module, script, args = config.get("module"), config.get("script"), config.get("script_args")
    head = ["-m", module] if isinstance(module, str) else \
        [Path(script).name] if isinstance(script, str) else ["?"]
    words = [a for a in args if isinstance(a, str)] if isinstance(args, list) else []
    return shlex.join([*head, *words])


def _stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "median": None, "p95": None, "max": None}
    ordered = sorted(values)
    return {"count": len(values), "median": round(statistics.median(ordered), 6),
            "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 6),
            "max": round(ordered[-1], 6)}


def _newest_readable(jd: JobDir) -> int | None:
    """The newest committed step whose manifest parses (files not verified)."""
    for step in committed_steps(jd.checkpoints):
        try:
            read_manifest(jd.checkpoints / step_dir_name(step))
        except (CheckpointCorruptError, IncompatibleFormatError):
            continue
        return step
    return None


_LIVE_STATES = ("starting", "running", "restarting")
"""States a supervisor leaves only by writing another: the last of a dead one's says nothing."""


def supervisor_alive(pid: Any, start_s: Any) -> bool:
    """True when process ``pid`` exists and started at ``start_s`` (psutil's ``create_time``,
    seconds; 1 s of slack), so a reused pid does not count. Unknown values count as alive."""
    import psutil

    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True
    try:
        proc = psutil.Process(pid)
        if isinstance(start_s, (int, float)) and abs(proc.create_time() - start_s) > 1.0:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _liveness(jd: JobDir, config: dict[str, Any], last_state: str | None) -> tuple[bool, str]:
    """``(is_running, state)``: running only while the job dir's lock is held *and* the
    supervisor named in ``config.json`` (``supervisor_pid``, ``supervisor_start_s``) is alive.
    A process that inherited the lock does not make a dead supervisor live. A job whose last
    state is a live one but whose supervisor is gone is ``dead (supervisor pid N gone)``."""
    pid = config.get("supervisor_pid")
    alive = supervisor_alive(pid, config.get("supervisor_start_s"))
    if jd.is_locked() and alive:
        return True, "running"
    if last_state in _LIVE_STATES or last_state is None and pid is not None:
        return False, f"dead (supervisor pid {pid} gone)" if pid is not None else "dead"
    return False, last_state or "unknown"


def _restart(e: dict[str, Any]) -> dict[str, Any]:
    """One ``failure`` event as a row of :func:`status`'s ``restarts``: its cause with the
    script's own message (``detail``) when that says more, and where it happened (``at step
    N``, ``before the first step``)."""
    cause, detail, step = e.get("cause"), e.get("detail"), e.get("step")
    if detail and detail != cause:
        cause = f"{cause} ({detail})"
    if e.get("made_a_step") is False:
        where = "before the first step"
    else:
        where = f"at step {step}" if step is not None else "at step unknown"
    return {"attempt": e.get("attempt"), "cause": cause, "step": step, "where": where}


def status(jd: JobDir) -> dict[str, Any]:
    """The job's state as a JSON-able dict (the ``cfrun status --json`` schema).

    ``state`` is ``running`` only while the supervisor lives (:func:`_liveness`), else the
    last state it wrote (``succeeded``, ``failed``, ``fatal``, ``preempted``) or ``dead
    (supervisor pid N gone)`` when it died without one.

    Keys: job_dir, script, module, command, state, is_running, current_step, total_steps,
    steps_per_s, eta_s, last_committed_step, resume_command (:func:`summary`), interval
    ({steps, why}), overhead ({budget_pct, stall_pct, definition}:
    :func:`cfrun.contract.events.overhead_seconds`, live), stall_s and pgt_s statistics
    ({count, median, p95, max}), checkpoints_taken, checkpoints_failed (steps the agent could
    not write or commit), checkpoints_skipped (steps skipped for lack of space), attempts,
    restarts ([{attempt, cause, step, where}]), disk_bytes, error (the message that stopped a
    ``fatal`` or ``failed`` job, e.g. a crash loop's exception; None otherwise), unprotected
    ([{attempt, step, where, error}]: a rank ran without cfrun's protection, e.g. no optimizer
    ever stepped), gpus ([{index, uuid, name, memory_used_bytes, memory_total_bytes,
    utilization_pct}] of this machine's visible GPUs, through NVML; empty without), progress
    ({step, done_batches, total_batches} at the newest checkpoint whose epoch loop is a
    ``range()`` over a loader of known length; None otherwise), last_resume (the newest
    resume's breakdown, :func:`last_resume`; None without one), goodput (the wall time split
    into productive training and what was lost per cause, and the ETTR:
    :func:`cfrun.contract.goodput.goodput`; None before any attempt). Unknown
    values are None (JSON null); the table says what they mean.
    """
    config = _read_json(jd.config_path, MAX_CONFIG_BYTES)
    events = read_events(jd)
    states = [e for e in events if e.get("event") == "state"]
    head = summary(jd, config, events)
    running = head["is_running"]
    ckpts = [e for e in events if e.get("event") == "checkpoint"]
    stall_total_s, wall_s = overhead_seconds(events, now_unix_s=time.time() if running
                                             else None)
    interval = config.get("interval")
    strategy = {}
    if os.path.lexists(jd.strategy_path):
        strategy = _read_json(jd.strategy_path, MAX_CONFIG_BYTES)
    return {
        **head,
        "interval": {"steps": interval, "why": "fixed by --interval"} if interval is not None
        else {"steps": strategy.get("interval"),
              "why": f"policy ({strategy.get('source', 'profiling')}): "
                     f"{strategy.get('reason', 'not decided yet')}"},
        "overhead": {"budget_pct": round(100 * float(config.get("overhead", 0.035)), 3),
                     "stall_pct": round(100 * stall_total_s / wall_s, 3) if wall_s else None,
                     "definition": OVERHEAD_DEFINITION},
        "stall_s": _stats([float(e["stall_s"]) for e in ckpts if "stall_s" in e]),
        "pgt_s": _stats([float(e["pgt_s"]) for e in ckpts if "pgt_s" in e]),
        "checkpoints_taken": len(ckpts),
        "checkpoints_failed": len({e.get("step") for e in events
                                   if e.get("event") == "persist_failed"}),
        "checkpoints_skipped": len({e.get("step") for e in events
                                    if e.get("event") == "checkpoint_skipped"}),
        "attempts": len([e for e in events if e.get("event") == "attempt_start"]),
        "restarts": [_restart(e) for e in events if e.get("event") == "failure"],
        "preempted": [{"step": e.get("step"), "final_checkpoint": e.get("final_checkpoint")}
                      for e in events if e.get("event") == "preempted"],
        "disk_bytes": tree_bytes(jd.checkpoints),
        "gpus": [g.to_json() for g in gpus.samples()],
        "progress": next(({"step": e.get("step"), **e["progress"]} for e in reversed(ckpts)
                          if isinstance(e.get("progress"), dict)), None),
        "error": states[-1].get("error") if states and not running
        and states[-1].get("state") in ("fatal", "failed") else None,
        "unprotected": [{"attempt": e.get("attempt"), "step": e.get("step"),
                         "where": e.get("where"), "error": e.get("error")}
                        for e in events if e.get("event") == "unprotected"],
        "last_resume": last_resume(events),
        "goodput": goodput(events, now_unix_s=time.time() if running else None),
        "resharded": [{"attempt": e.get("attempt"), "step": e.get("step"),
                       "from_world_size": e.get("from_world_size"),
                       "to_world_size": e.get("to_world_size")}
                      for e in events if e.get("event") == "resharded"],
    }


RESUME_PHASES = ("backoff", "launch", "import", "agent_wait", "read", "to_boundary", "restore")
"""The parts of a resume that :func:`last_resume` reports, in order."""


def last_resume(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest resume's breakdown from the events (rank 0's ``resumed`` and the supervisor's
    ``attempt_end``/``attempt_start`` around it): ``{attempt, step, total_s, <phase>_s...}``
    for :data:`RESUME_PHASES`: ``backoff`` (the previous attempt's end to this one's start),
    ``launch`` (torchrun's start and rendezvous, to the rank process's creation), ``import``
    (interpreter, torch, cfrun's hooks), ``agent_wait`` (waiting for the persist agent to
    finish the earlier attempt's hand-off), ``read`` (verify and load the checkpoint),
    ``to_boundary`` (the script's start-up and fast-forward), ``restore``; ``total_s`` from the
    previous attempt's end to the restore's end. A part whose timestamps are missing (an older
    cfrun, a resume in a new cfrun run) is None. None when no resume happened. Never raises
    for odd events."""
    resumed = [e for e in events if e.get("event") == "resumed" and e.get("rank", 0) == 0]
    if not resumed:
        return None
    r = resumed[-1]
    attempt = r.get("attempt")

    def t(kind: str, att: Any) -> float | None:
        got = [e.get("t_unix_s") for e in events if e.get("event") == kind
               and e.get("attempt") == att]
        return float(got[-1]) if got and isinstance(got[-1], (int, float)) else None

    def num(key: str) -> float | None:
        v = r.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    def d(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    end_before = t("attempt_end", attempt - 1) if isinstance(attempt, int) else None
    start = t("attempt_start", attempt)
    proc, read0, read_s = num("process_start_unix_s"), num("read_start_unix_s"), num("read_s")
    agent_s, restore_s, done = num("agent_wait_s"), num("restore_s"), num("t_unix_s")
    read_end = None if read0 is None or read_s is None else read0 + read_s
    import_end = None if read0 is None else read0 - (agent_s or 0.0)
    return {"attempt": attempt, "step": r.get("step"), "total_s": d(end_before, done),
            "backoff_s": d(end_before, start), "launch_s": d(start, proc),
            "import_s": d(proc, import_end), "agent_wait_s": agent_s, "read_s": read_s,
            "to_boundary_s": d(read_end, None if done is None or restore_s is None
                               else done - restore_s),
            "restore_s": restore_s}


def checkpoints(jd: JobDir, *, check: bool = True) -> list[dict[str, Any]]:
    """Committed checkpoints, newest first: step, epoch, batches, bytes, age_s, verified,
    final (the checkpoint taken at the script's end, which holds no data position: its epoch
    and batches are None; issue 27, item 2).

    ``verified`` is ``ok``, ``corrupt: <why>`` or ``unchecked`` (``check=False``). Verifying
    (:func:`cfrun.contract.checkpoints.verify`) streams each file through its checksum after
    checking that it is a regular file of the recorded size, and checks every rank's tensor
    table, without torch.
    """
    out: list[dict[str, Any]] = []
    now = time.time()
    for step in committed_steps(jd.checkpoints):
        d = jd.checkpoints / step_dir_name(step)
        try:
            manifest = read_manifest(d)
        except (CheckpointCorruptError, IncompatibleFormatError) as e:
            out.append({"step": step, "epoch": None, "batches": None, "bytes": None,
                        "age_s": None, "verified": f"corrupt: {e}", "final": None})
            continue
        verified = "unchecked"
        if check:
            try:
                verify(d)
                verified = "ok"
            except (CheckpointCorruptError, IncompatibleFormatError) as e:
                verified = f"corrupt: {e}"
        meta = manifest.meta
        out.append({"step": step, "epoch": meta.get("epoch"), "batches": meta.get("batches"),
                    "bytes": manifest.nbytes,
                    "age_s": round(now - manifest.committed_unix_s, 1),
                    "verified": verified, "final": meta.get("final") is True})
    return out


def check_listing(rows: list[dict[str, Any]]) -> None:
    """After ``cfrun ls`` printed ``rows``: fail if one of them is corrupt.

    Raises:
        CheckpointCorruptError: the first corrupt checkpoint, in one line (exit code 5).
    """
    bad = [r for r in rows if str(r["verified"]).startswith("corrupt")]
    if bad:
        raise CheckpointCorruptError(
            f"{len(bad)} of {len(rows)} checkpoints are corrupt; step {bad[0]['step']}: "
            f"{str(bad[0]['verified']).removeprefix('corrupt: ')}",
            hint="a resume skips them and uses the newest one marked ok")


def _save_dcp(state: dict[str, Any], directory: Path) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into the new ``directory`` (one
    process, no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled...": one process, meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def _write_export(f: BinaryIO, obj: Any, modules: list[dict[str, Any]], fmt: str,
                  step: int) -> None:
    """Write an export file to ``f``: ``torch.save`` of ``obj``, or safetensors of
    ``modules`` (keys prefixed ``model0.`` etc. when there are several).

    Raises:
        BadInputError: safetensors is not installed.
    """
    import torch

    if fmt == "torch":
        torch.save(obj, f)
        return
    try:
        from safetensors.torch import save
    except ImportError:
        raise BadInputError("--format safetensors needs the safetensors package; "
                            "pip install safetensors") from None
    flat = {}
    for i, m in enumerate(modules):
        for k, v in m.items():
            flat[k if len(modules) == 1 else f"model{i}.{k}"] = v.contiguous()
    f.write(save(flat, metadata={"cfrun_step": str(step)}))


def _full_modules(step_dir: Path, modules: list[Any]) -> list[Any]:
    """Rank 0's model state dicts of a sharded checkpoint with every DTensor's local shard
    replaced by the full tensor, put together from every rank's shard
    (:func:`cfrun.codec.dtensor.gather_full`; each rank's files verified as they are read).
    Holds the full model and one rank's state at a time.

    Raises:
        BadInputError: a rank's shard fails verification, or the shards cannot be put
            together (a placement export does not handle), in one line.
    """
    from cfrun.codec.checkpoint import load_shard
    from cfrun.codec.dtensor import LocalShard, gather_full

    parts: dict[tuple[int, str], list[LocalShard]] = {}
    try:
        for q in range(read_manifest(step_dir).world_size):
            q_modules = modules if q == 0 else load_shard(step_dir, q)[0]["modules"]
            for i, sd in enumerate(q_modules):
                for k, v in sd.items():
                    if isinstance(v, LocalShard):
                        parts.setdefault((i, k), []).append(v)
        return [{k: gather_full(parts[(i, k)]) if isinstance(v, LocalShard) else v
                 for k, v in sd.items()} for i, sd in enumerate(modules)]
    except (CheckpointCorruptError, IncompatibleFormatError, ValueError, KeyError,
            TypeError, IndexError, RuntimeError) as e:
        raise BadInputError(f"checkpoint {step_dir.name} of a sharded job cannot be "
                            f"exported ({e}); export another --step") from None


def export_note(jd: JobDir, step: int, *, asked: bool) -> str:
    """What ``cfrun export`` says about the step it exported (issue 27, item 2): that it is
    the last step the script ran (the newest heartbeat, :func:`co.newest_heartbeat_step`),
    or why not: asked for with ``--step``; the job still runs; the job finished but its
    final checkpoint failed (the ``final_checkpoint`` event's reason) or was never taken (a
    cfrun before final checkpoints); or the job did not finish (stopped, failed, preempted),
    so the steps after its newest checkpoint were not saved. Reads only."""
    from cfrun.supervisor.admission import finished_at

    last = co.newest_heartbeat_step(jd.root)
    if last is None or step >= last:
        return "the last step the script ran" if last is not None else "the newest checkpoint"
    head = f"not the last step the script ran ({last}): "
    if asked:
        return head + "asked for with --step"
    if jd.is_locked():
        return head + "the job is still running; export again when it has finished"
    if finished_at(jd, 0) is None:
        return head + ("the job did not finish (it stopped, failed or was preempted): the "
                       f"steps after {step} were not checkpointed; resume it to go on")
    try:
        events = read_events(jd)
    except BadInputError:  # unreadable: no reason to cite
        events = []
    finals = [e for e in events if e.get("event") == "final_checkpoint"
              and e.get("step") == last]
    if finals and finals[-1].get("error"):
        return head + f"the final checkpoint at the script's end failed ({finals[-1]['error']})"
    return head + "the job finished without a final checkpoint (written by a cfrun that took none)"


def export(jd: JobDir, out: Path, *, step: int | None, fmt: str) -> tuple[int, int]:
    """Write the model weights of a checkpoint as a plain file. Returns (step, tensors).

    ``torch``: a ``torch.save`` file of the model's ``state_dict`` (``{"model0": ..., ...}``
    when the script trains several models) that loads with ``torch.load(weights_only=True)``.
    ``safetensors``: the same tensors, keys prefixed ``model0.`` etc. when there are several.
    ``dcp``: a ``torch.distributed.checkpoint`` directory of the same state dict (``out`` is a
    new directory), written in this one process (``no_dist``); DCP's ``load`` and
    ``format_utils.dcp_to_torch_save`` read it, as TorchTitan's model-only checkpoints are read.
    A sharded job's checkpoint (FSDP2, tensor parallelism) exports full tensors, put together
    from every rank's local shards (:func:`_full_modules`); DCP's ``load`` reads the slices a
    model sharded on any world size needs (issue 25, item 5).

    Raises:
        BadInputError: unknown format, no such step, the step fails verification, or ``out``
            cannot be written (nothing is left at ``out`` then, and an existing file stays).
    """
    import torch

    from cfrun.codec.checkpoint import load_shard
    from cfrun.codec.dtensor import has_shards

    if fmt not in ("torch", "safetensors", "dcp"):
        raise BadInputError(f"--format {fmt!r} is not supported; give torch, safetensors or dcp")
    steps = committed_steps(jd.checkpoints)
    if not steps:
        raise BadInputError(f"{str(jd.root)!r} has no committed checkpoint yet")
    if step is None:
        step = steps[0]
    elif step not in steps:
        raise BadInputError(f"--step {step} has no committed checkpoint; available: "
                            + ", ".join(map(str, steps)))
    try:
        state, _ = load_shard(jd.checkpoints / step_dir_name(step), 0)
    except (CheckpointCorruptError, IncompatibleFormatError) as e:
        raise BadInputError(f"checkpoint step {step} failed verification ({e}); "
                            "export another --step") from None
    modules = state.get("modules") if isinstance(state, dict) else None
    if isinstance(modules, list) and has_shards(modules):  # a sharded job (FSDP2, TP)
        modules = _full_modules(jd.checkpoints / step_dir_name(step), modules)
    if not isinstance(modules, list) or not all(
            isinstance(m, dict) and all(isinstance(v, torch.Tensor) for v in m.values())
            for m in modules):
        raise BadInputError(f"checkpoint step {step} holds no model weights cfrun wrote "
                            "(no list of state_dicts under 'modules'); export another --step")
    # written beside ``out`` under a fresh random name (O_EXCL: a link or file planted at a
    # predictable name is never followed nor overwritten; issue 24, item 10) and renamed: a
    # failed export leaves no torn file and an existing ``out`` as it was
    obj = modules[0] if len(modules) == 1 else {f"model{i}": m for i, m in enumerate(modules)}
    tmp = ""
    try:
        if fmt == "dcp":
            tmp = tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".cfrun-tmp")
            _save_dcp(obj, Path(tmp))
        else:
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.",
                                       suffix=".cfrun-tmp")
            with os.fdopen(fd, "wb") as f:
                _write_export(f, obj, modules, fmt, step)
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(f.fileno(), 0o666 & ~umask)  # as torch.save's file would be
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:  # torch.save wraps I/O errors in RuntimeError
        raise BadInputError(f"cannot write {str(out)!r} ({getattr(e, 'strerror', None) or e}); "
                            "give a writable path with free space") from None
    finally:
        if tmp and os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp and os.path.lexists(tmp):
            os.unlink(tmp)
    return step, sum(len(m) for m in modules)
