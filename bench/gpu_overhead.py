"""What a checkpoint costs the training step, cfrun against DCP and torch.save (issue 23).

Contenders, run one after another by this process (one process tree) on the same work, the
unmodified script ``bench/_gpu_overhead_train.py``:

* ``plain``: no checkpoints (the baseline);
* with ``--idle``, what cfrun costs a step that takes no checkpoint, in two parts (issue 23:
  the H200 ran every step ~0.6 ms slower in median under cfrun, with or without a persist):
  ``torchrun_plain``, the script under ``torchrun --standalone --nproc-per-node 1`` (the
  launcher and its environment, no cfrun), and ``cfrun_idle``, ``cfrun --interval 100000``
  (cfrun's hooks, supervisor, agent and prepared slot, no checkpoint in the run);
* ``cfrun_policy``: ``cfrun --overhead 3.5%`` (its profile, then its interval); its persist
  times also give ``k* = ceil(persist / step)``, the least interval at which one checkpoint's
  persist ends before the next is due;
* ``cfrun_k``, ``cfrun_2k``, ``cfrun_5k``: ``cfrun --interval`` k*, 2k*, 5k*;
* ``dcp_k``..: ``torch.distributed.checkpoint.async_save`` every k*, 2k*, 5k* steps (at most one
  in flight), and ``torch_save_k``..: ``torch.save`` + fsync, at the same intervals (these run
  in one process, after each other, on the same model).

Workloads (``--workloads``): ``gpt`` (24 layers x 1024, sequence 1024, batch 8 on a GPU) and
``resnet`` (ResNet-50's layout written without torchvision, batch 128, channels-last, bf16 on
a GPU); ``--size small`` runs CPU-sized variants of both (see the training script).

Per contender: mean and p99 step time (ms; the first iterations are warm-up), overhead =
mean / the mean of the two plain runs (the first contender and ``plain_after``, the last)
- 1, checkpoints taken, the stall of the first checkpoint and the median and largest of the
others (cfrun: ``stall_s`` from events.jsonl; DCP and torch.save: the save
call), cfrun's deferred checkpoints (``checkpoint_deferred`` events), and the median snapshot
and persist (DCP: trigger to durable) against the measured floors: ``copy``, one copy of the
state's bytes into a reused (on CUDA: page-locked) host buffer, and ``disk``, a write + fsync
of as many bytes beside the job dirs. Raw JSON goes to ``bench/results/gpu_overhead.json``.

Usage::

    .venv/bin/python bench/gpu_overhead.py --size small   # CPU, ~2 minutes on 2 idle cores
    python bench/gpu_overhead.py --size full              # one GPU
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from checkpoint_overhead import child_env, measure_disk, measure_memcpy, median  # noqa: E402

TRAIN = BENCH_DIR / "_gpu_overhead_train.py"
DEFAULT_OUT = BENCH_DIR / "results" / "gpu_overhead.json"
STEPS = {"small": 40, "full": 120}
"""Iterations per contender run (the policy run gets :data:`POLICY_STEPS` more)."""
POLICY_STEPS = 60
"""Extra iterations of the ``--overhead`` run: its profile takes about 50."""
IDLE_INTERVAL = 100_000
"""``cfrun_idle``'s interval: no checkpoint in the run."""
ROW_FIELDS = ("name", "kind", "k", "ok", "mean_ms", "median_ms", "p99_ms", "overhead", "checkpoints",
              "stall_first_s", "stall_rest_median_s", "stall_rest_max_s", "deferred",
              "snapshot_s", "persist_s", "snapshot_over_copy_floor", "persist_over_disk_floor",
              "stall_parts")
"""Every row of the JSON has these (None where a contender has no such figure)."""


def run(cmd: list[str], cwd: Path, timeout_s: float) -> tuple[list[dict], str]:
    """Run ``cmd``; its ``RESULT`` lines (parsed) and, on failure, the end of its stderr."""
    try:
        p = subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout_s} s"
    results = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines()
               if line.startswith("RESULT ")]
    return results, "" if p.returncode == 0 else f"exit {p.returncode}: {p.stderr[-2000:]}"


def events(job_dir: Path) -> list[dict]:
    """The job's events.jsonl, parsed (empty when missing)."""
    path = job_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def row(name: str, kind: str, k: int, result: dict | None, error: str, stall_s: list[float],
        snapshot_s: list[float], persist_s: list[float], deferred: int | None,
        plain_mean_ms: float | None, floors: dict) -> dict:
    """One contender's figures (:data:`ROW_FIELDS`) from its run's result and checkpoints."""
    iters = (result or {}).get("iter_ms") or []
    mean_ms = statistics.fmean(iters) if iters else None
    median_ms = statistics.median(iters) if iters else None
    p99_ms = sorted(iters)[min(len(iters) - 1, math.ceil(0.99 * len(iters)) - 1)] if iters \
        else None
    snap, pers = median(snapshot_s), median(persist_s)
    return {
        "name": name, "kind": kind, "k": k, "ok": bool(iters) and not error, "error": error,
        "mean_ms": mean_ms, "median_ms": median_ms, "p99_ms": p99_ms,
        "overhead": (mean_ms / plain_mean_ms - 1) if mean_ms and plain_mean_ms else None,
        "checkpoints": len(stall_s), "stall_first_s": stall_s[0] if stall_s else None,
        "stall_rest_median_s": median(stall_s[1:]),
        "stall_rest_max_s": max(stall_s[1:], default=None), "deferred": deferred,
        "snapshot_s": snap, "persist_s": pers,
        "snapshot_over_copy_floor": snap / floors["copy_s"] if snap else None,
        "persist_over_disk_floor": pers / floors["disk_s"] if pers else None,
        "iter_ms": iters, "stall_s": stall_s, "stall_parts": None,
    }


def cfrun_row(name: str, k: int, args: list[str], model: str, size: str, steps: int,
              work: Path, timeout_s: float, plain_mean_ms: float | None, floors: dict) -> dict:
    """Run the script under ``cfrun ARGS`` and read its checkpoints from events.jsonl."""
    job = work / name
    cmd = [sys.executable, "-m", "cfrun", *args, "--max-restarts", "0", "--job-dir", str(job),
           str(TRAIN), "--model", model, "--size", size, "--steps", str(steps)]
    results, error = run(cmd, work, timeout_s)
    evs = events(job)
    ckpts = sorted((e for e in evs if e["event"] == "checkpoint"), key=lambda e: e["step"])
    deferred = sum(e["event"] == "checkpoint_deferred" for e in evs)
    out = row(name, "cfrun", k, results[0] if results else None, error,
              [e["stall_s"] for e in ckpts], [e["snapshot_s"] for e in ckpts],
              [e["persist_s"] for e in ckpts], deferred, plain_mean_ms, floors)
    out["events"] = evs  # the job's events.jsonl, raw: the policy's plans, the deferrals
    # where the stall went (median seconds over the checkpoints after the first): the capture
    # and the copies' start at the boundary, and the device's wait at the next step (CUDA)
    out["stall_parts"] = {k: median([e[k] for e in ckpts[1:] if e.get(k) is not None])
                          for k in ("capture_s", "enqueue_s", "gate_device_s")}
    return out


def copy_floor_s(state_bytes: int) -> float:
    """Seconds of one copy of ``state_bytes`` into a reused host buffer: from the GPU into a
    page-locked one (median of 5), else :func:`checkpoint_overhead.measure_memcpy`."""
    if not torch.cuda.is_available():
        return measure_memcpy(state_bytes, repeats=3)["reused_buffer_s"]
    src = torch.ones(state_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times)


def workload(model: str, size: str, steps: int, work: Path, timeout_s: float,
             policy_steps: int = POLICY_STEPS, multiples: tuple[int, ...] = (1, 2, 5),
             baselines: tuple[str, ...] = ("dcp_thread", "torch_save"),
             partial: Path | None = None, idle: bool = False) -> dict:
    """Every contender on one workload; returns its rows, k*, the floors and the state size.
    ``partial``: a file rewritten with the rows so far after each one (a run cut off by a time
    limit keeps what finished). ``idle``: the ``torchrun_plain`` and ``cfrun_idle`` rows."""
    work.mkdir(parents=True)

    def keep(rows: list[dict], **more) -> None:
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"model": model, "size": size, "rows": rows, **more}))

    base = [sys.executable, str(TRAIN), "--model", model, "--size", size, "--steps", str(steps),
            "--ckpt-dir", str(work / "ckpt")]
    plain_res, plain_err = run([*base, "--contenders", "plain:none:0"], work, timeout_s)
    plain = plain_res[0] if plain_res else None
    state_bytes = plain["state_bytes"] if plain else 1
    floors = {"copy_s": copy_floor_s(state_bytes),
              "disk_s": measure_disk(str(work), state_bytes, repeats=2)["write_fsync_s"]}
    plain_row = row("plain", "none", 0, plain, plain_err, [], [], [], None, None, floors)
    plain_ms = plain_row["mean_ms"]
    rows = [plain_row]
    keep(rows, floors=floors, state_bytes=state_bytes)
    if idle:
        script = base[1:base.index("--ckpt-dir")]
        res, err = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "1", *script, "--contenders",
                        "torchrun_plain:none:0"], work, timeout_s)
        rows.append(row("torchrun_plain", "none", 0, res[0] if res else None, err, [], [], [],
                        None, plain_ms, floors))
        rows.append(cfrun_row("cfrun_idle", IDLE_INTERVAL, ["--interval", str(IDLE_INTERVAL)], model, size,
                              steps, work, timeout_s, plain_ms, floors))
        keep(rows, floors=floors, state_bytes=state_bytes)
    rows.append(cfrun_row("cfrun_policy", 0, ["--overhead", "3.5%"], model, size,
                          steps + policy_steps, work, timeout_s, plain_ms, floors))
    keep(rows, floors=floors, state_bytes=state_bytes)
    persist_s = rows[-1]["persist_s"] or floors["disk_s"]
    step_s = statistics.median(plain["iter_ms"]) / 1e3 if plain else 1.0
    k_star = max(1, math.ceil(persist_s / step_s))
    ks = {("k" if m == 1 else f"{m}k"): m * k_star for m in multiples}
    for tag, k in ks.items():
        rows.append(cfrun_row(f"cfrun_{tag}", k, ["--interval", str(k)], model, size,
                              max(steps, 3 * k + 6), work, timeout_s, plain_ms, floors))
        keep(rows, floors=floors, state_bytes=state_bytes, k_star=k_star)
    specs = [f"{kind}_{tag}:{kind}:{k}:{max(steps, 3 * k + 6)}"
             for kind in baselines for tag, k in ks.items()]
    in_script, err = run([*base, "--contenders", ",".join(specs)], work, 2 * timeout_s) \
        if specs else ([], "")
    by_name = {r["name"]: r for r in in_script}
    for spec in specs:
        name, kind, k, _ = spec.split(":")
        r = by_name.get(name)
        stall = (r or {}).get("stall_s") or []
        rows.append(row(name, kind, int(k), r, err if r is None else "", stall, stall,
                        (r or {}).get("pgt_s") or [], None, plain_ms, floors))
    # the plain script again, last: a GPU that warms up over the run (its clocks) or a machine
    # that gets busier slows the later contenders; the baseline is the mean of both plain runs
    after_res, after_err = run([*base, "--contenders", "plain_after:none:0"], work, timeout_s)
    after = row("plain_after", "none", 0, after_res[0] if after_res else None, after_err, [],
                [], [], None, None, floors)
    rows.append(after)
    if plain_ms and after["mean_ms"]:
        baseline_ms = (plain_ms + after["mean_ms"]) / 2
        for r in rows:
            r["overhead_vs_first_plain"] = r["overhead"]
            r["overhead"] = r["mean_ms"] / baseline_ms - 1 if r["mean_ms"] else None
    return {"model": model, "size": size, "state_bytes": state_bytes, "k_star": k_star,
            "step_s": step_s, "persist_for_k_star_s": persist_s, "floors": floors,
            "rows": rows}


def _fmt(x: float | None, scale: float = 1.0, spec: str = ".3g") -> str:
    return "-" if x is None else format(x * scale, spec)


def report(result: dict) -> None:
    """Print one workload's table: ratios against plain and against the floors."""
    print(f"\n{result['model']} ({result['size']}): state {result['state_bytes'] / 1e6:.1f} MB, "
          f"step {result['step_s'] * 1e3:.1f} ms, k* = {result['k_star']}, floors: copy "
          f"{result['floors']['copy_s'] * 1e3:.1f} ms, disk {result['floors']['disk_s']:.3f} s")
    print(f"{'contender':16} {'k':>6} {'mean ms':>8} {'med ms':>8} {'p99 ms':>8} {'overhead':>9} {'ckpts':>5} "
          f"{'stall1 s':>8} {'stall s':>8} {'max s':>8} {'defer':>5} {'snap/flr':>8} "
          f"{'pers/flr':>8}")
    for r in result["rows"]:
        print(f"{r['name']:16} {r['k']:>6} {_fmt(r['mean_ms'], 1, '.1f'):>8} "
              f"{_fmt(r['median_ms'], 1, '.2f'):>8} "
              f"{_fmt(r['p99_ms'], 1, '.1f'):>8} {_fmt(r['overhead'], 100, '+.1f') + '%':>9} "
              f"{r['checkpoints']:>5} {_fmt(r['stall_first_s']):>8} "
              f"{_fmt(r['stall_rest_median_s']):>8} {_fmt(r['stall_rest_max_s']):>8} "
              f"{'-' if r['deferred'] is None else r['deferred']:>5} "
              f"{_fmt(r['snapshot_over_copy_floor']):>8} {_fmt(r['persist_over_disk_floor']):>8}"
              + ("" if r["ok"] else f"  FAILED {r['error'][:80]}"))
    for r in result["rows"]:
        if r.get("stall_parts"):
            print(f"  {r['name']}: stall parts (median after the first, ms): " + ", ".join(
                f"{k[:-2]} {_fmt(v, 1e3, '.2f')}" for k, v in r["stall_parts"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["small", "full"], default="small")
    ap.add_argument("--workloads", default="gpt,resnet")
    ap.add_argument("--steps", type=int, default=None, help="iterations per run")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tmp-root", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--multiples", default="1,2,5",
                    help="the fixed intervals, as multiples of k*")
    ap.add_argument("--baselines", default="dcp_thread,torch_save",
                    help="in-script contenders at the same intervals (empty: none)")
    ap.add_argument("--idle", action="store_true",
                    help="also torchrun_plain and cfrun_idle: a step's cost without checkpoints")
    ap.add_argument("--policy-steps", type=int, default=POLICY_STEPS,
                    help="extra iterations of the --overhead run (its profile takes ~50)")
    args = ap.parse_args(argv)
    steps = args.steps or STEPS[args.size]
    out = {"size": args.size, "steps": steps, "device": "cuda" if torch.cuda.is_available()
           else "cpu", "torch": torch.__version__, "workloads": []}
    with tempfile.TemporaryDirectory(dir=args.tmp_root, prefix="gpu-overhead-") as tmp:
        for name in args.workloads.split(","):
            partial = args.out.with_name(f"{args.out.stem}.{name}.partial.json")
            result = workload(name, args.size, steps, Path(tmp) / name, args.timeout,
                              args.policy_steps, tuple(int(m) for m in args.multiples.split(",") if m),
                              tuple(b for b in args.baselines.split(",") if b), partial,
                              args.idle)
            out["workloads"].append(result)
            partial.unlink(missing_ok=True)
            report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\nraw results: {args.out}")
    return 0 if all(r["ok"] for w in out["workloads"] for r in w["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
