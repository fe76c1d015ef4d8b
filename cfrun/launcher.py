"""Build the torchrun command line and the ranks' environment (pure), then start torchrun.

The ranks run as ``python -m torch.distributed.run --standalone ... SCRIPT ARGS`` (one node) or
with torchrun's c10d rendezvous (``--nnodes N``) with the same
interpreter as cfrun. cfrun restarts torchrun itself (``--max-restarts 0`` to torchrun) so that
it can apply its own policy and keep the persist agent across restarts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cfrun
from cfrun import env as E
from cfrun.config import RunConfig


def hooks_dir() -> Path:
    """Directory holding cfrun's ``sitecustomize.py``: in the wheel, or in a source checkout."""
    pkg = Path(cfrun.__file__).resolve().parent
    for candidate in (pkg / "_hooks", pkg.parent / "hooks"):
        if (candidate / "sitecustomize.py").is_file():
            return candidate
    raise FileNotFoundError(f"cfrun's hooks/sitecustomize.py is missing next to {pkg}")


def build_torchrun_argv(cfg: RunConfig, *, python: str = sys.executable) -> list[str]:
    """The torchrun command for one attempt (no I/O).

    One node: ``--standalone``. Several: torchrun's c10d rendezvous at ``--rdzv-endpoint`` (the
    first node there to bind the port hosts the store; torchrun ``--rdzv-backend c10d``), with a
    fixed node count, so the world size cannot change between restarts.
    """
    if cfg.nnodes > 1:
        launch = [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.rdzv_endpoint}",
                  f"--rdzv-id={cfg.rdzv_id}"]
    else:
        launch = ["--standalone"]
    return [
        python, "-m", "torch.distributed.run",
        *launch,
        f"--nproc-per-node={cfg.nproc_per_node}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        cfg.script, *cfg.script_args,
    ]


def build_worker_env(cfg: RunConfig, attempt: int, base: dict[str, str] | None = None, *,
                     agent: bool = True, mtbf_s: float | None = None) -> dict[str, str]:
    """The environment of torchrun and its ranks for attempt ``attempt`` (no I/O).

    ``hooks/`` goes first on PYTHONPATH (ranks only: cfrun's own process is untouched).
    """
    env = dict(os.environ if base is None else base)
    env.pop(E.HOOK_OWNER_PID, None)
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks_dir()), old) if p)
    env.update({
        E.RANK_ACTIVE: "1",
        E.RANK_JOB_DIR: cfg.job_dir,
        E.RANK_SCRIPT: cfg.script,
        E.RANK_ATTEMPT: str(attempt),
        E.RANK_INTERVAL: str(cfg.interval) if cfg.interval is not None else "",
        E.RANK_OVERHEAD: repr(cfg.overhead),
        E.RANK_MTBF_S: repr(mtbf_s) if mtbf_s else "",
        E.RANK_PROFILE_ONLY: "1" if cfg.profile_only else "0",
        E.RANK_KEEP: str(cfg.keep),
        E.RANK_INJECT_CRASH: cfg.inject_crash,
        E.RANK_FF_EVAL: env.get(E.FF_EVAL, "one"),
        E.RANK_AGENT: "1" if agent else "0",
    })
    return env


def spawn(argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen[bytes]:
    """Start torchrun in its own process group (so signals reach the whole tree)."""
    return subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)
