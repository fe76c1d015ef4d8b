"""Read-only views of a job dir for ``cfrun status``, ``cfrun ls`` and ``cfrun export``.

Everything here reads files written by the supervisor, the ranks and the agent
(``config.json``, ``events.jsonl``, ``checkpoints/``, heartbeats); nothing is modified, so the
commands are safe on a live job. Checkpoints are loaded only after their checksums verify.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from cfrun.codec.checkpoint import committed_steps, load_shard, read_manifest, verify
from cfrun.contract.errors import BadInputError, CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.jobdir import JobDir, step_dir_name


def open_job_dir(path: str) -> JobDir:
    """A job dir that exists and has ``config.json``.

    Raises:
        BadInputError: missing, or not a cfrun job dir.
    """
    jd = JobDir(Path(path).expanduser())
    if not jd.root.is_dir():
        raise BadInputError(f"job dir {path!r} does not exist; give the --job-dir of a run "
                            "(default ./cfrun-jobs/<script name>)")
    if not jd.config_path.is_file():
        raise BadInputError(f"{path!r} is not a cfrun job dir (no config.json)")
    return jd


def _stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "median": None, "p95": None, "max": None}
    ordered = sorted(values)
    return {"count": len(values), "median": round(statistics.median(ordered), 6),
            "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 6),
            "max": round(ordered[-1], 6)}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def status(jd: JobDir) -> dict[str, Any]:
    """The job's state as a JSON-able dict (the ``cfrun status --json`` schema).

    Keys: job_dir, script, state, is_running, current_step, last_committed_step,
    interval ({steps, why}), overhead ({budget_pct, stall_pct}), stall_s and pgt_s statistics
    ({count, median, p95, max}), attempts, restarts ([{attempt, cause, step}]), disk_bytes.
    """
    config = json.loads(jd.config_path.read_text())
    events = jd.read_events()
    states = [e for e in events if e.get("event") == "state"]
    running = jd.is_locked()
    state = "running" if running else (states[-1]["state"] if states else "unknown")
    beats = []
    for p in jd.root.glob("heartbeat-rank-*"):
        try:
            beats.append(int(p.read_text().strip() or 0))
        except (OSError, ValueError):
            continue
    committed = committed_steps(jd.checkpoints)
    ckpts = [e for e in events if e.get("event") == "checkpoint"]
    attempts = [e for e in events if e.get("event") == "attempt_end"]
    wall_s = sum(float(e.get("duration_s", 0)) for e in attempts)
    stall_total_s = sum(float(e.get("stall_s", 0)) for e in ckpts)
    interval = config.get("interval")
    strategy = {}
    if (jd.root / "strategy.json").exists():
        strategy = json.loads((jd.root / "strategy.json").read_text())
    return {
        "job_dir": str(jd.root),
        "script": config.get("script"),
        "state": state,
        "is_running": running,
        "current_step": max(beats) if beats else None,
        "last_committed_step": committed[0] if committed else None,
        "interval": {"steps": interval, "why": "fixed by --interval"} if interval is not None
        else {"steps": strategy.get("interval"),
              "why": f"policy ({strategy.get('source', 'profiling')}): "
                     f"{strategy.get('reason', 'not decided yet')}"},
        "overhead": {"budget_pct": round(100 * float(config.get("overhead", 0.035)), 3),
                     "stall_pct": round(100 * stall_total_s / wall_s, 3) if wall_s else None},
        "stall_s": _stats([float(e["stall_s"]) for e in ckpts if "stall_s" in e]),
        "pgt_s": _stats([float(e["pgt_s"]) for e in ckpts if "pgt_s" in e]),
        "checkpoints_taken": len(ckpts),
        "attempts": len([e for e in events if e.get("event") == "attempt_start"]),
        "restarts": [{"attempt": e.get("attempt"), "cause": e.get("cause"), "step": e.get("step")}
                     for e in events if e.get("event") == "failure"],
        "preempted": [{"step": e.get("step"), "final_checkpoint": e.get("final_checkpoint")}
                      for e in events if e.get("event") == "preempted"],
        "disk_bytes": _dir_bytes(jd.checkpoints),
    }


def checkpoints(jd: JobDir, *, check: bool = True) -> list[dict[str, Any]]:
    """Committed checkpoints, newest first: step, epoch, batches, bytes, age_s, verified.

    ``verified`` is ``ok``, ``corrupt: <why>`` or ``unchecked`` (``check=False``).
    """
    out = []
    now = time.time()
    for step in committed_steps(jd.checkpoints):
        d = jd.checkpoints / step_dir_name(step)
        try:
            manifest = read_manifest(d)
        except (CheckpointCorruptError, IncompatibleFormatError) as e:
            out.append({"step": step, "epoch": None, "batches": None, "bytes": None,
                        "age_s": None, "verified": f"corrupt: {e}"})
            continue
        verified = "unchecked"
        if check:
            try:
                verify(d)
                verified = "ok"
            except (CheckpointCorruptError, IncompatibleFormatError) as e:
                verified = f"corrupt: {e}"
        meta = manifest.get("meta", {})
        out.append({"step": step, "epoch": meta.get("epoch"), "batches": meta.get("batches"),
                    "bytes": sum(int(f["nbytes"]) for f in manifest["files"]),
                    "age_s": round(now - float(manifest.get("committed_unix_s", now)), 1),
                    "verified": verified})
    return out


def export(jd: JobDir, out: Path, *, step: int | None, fmt: str) -> tuple[int, int]:
    """Write the model weights of a checkpoint as a plain file. Returns (step, tensors).

    ``torch``: a ``torch.save`` file of the model's ``state_dict`` (``{"model0": ..., ...}``
    when the script trains several models) that loads with ``torch.load(weights_only=True)``.
    ``safetensors``: the same tensors, keys prefixed ``model0.`` etc. when there are several.

    Raises:
        BadInputError: unknown format, no such step, or the step fails verification.
    """
    import torch

    if fmt not in ("torch", "safetensors"):
        raise BadInputError(f"--format {fmt!r} is not supported; give torch or safetensors")
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
    modules = state["modules"]
    if fmt == "torch":
        obj = modules[0] if len(modules) == 1 else {f"model{i}": m for i, m in enumerate(modules)}
        torch.save(obj, out)
    else:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise BadInputError("--format safetensors needs the safetensors package; "
                                "pip install safetensors") from None
        flat = {}
        for i, m in enumerate(modules):
            for k, v in m.items():
                flat[k if len(modules) == 1 else f"model{i}.{k}"] = v.contiguous()
        save_file(flat, str(out), metadata={"cfrun_step": str(step)})
    return step, sum(len(m) for m in modules)
