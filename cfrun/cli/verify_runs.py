"""The runs of a ``cfrun verify`` (:mod:`cfrun.cli.verify`): one run of the script under
cfrun's supervisor (:func:`run_supervised`), or without cfrun's runtime for ``--against-plain``
(:func:`plain_run`), each as a :class:`RunResult`; and what a run's job dir committed: the step
it stopped at (:func:`stopped_at`) and whether it holds a step's checkpoint
(:func:`has_checkpoint`)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cfrun.contract import verify as V
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import EXIT_PREEMPTED, CfrunError, JobFailedError


@dataclass
class RunResult:
    """One run of a verify: its name, job dir, seconds and exit code."""

    name: str
    job_dir: Path
    seconds: float = 0.0
    exit_code: int | None = None


def stopped_at(job_dir: Path, stop_step: int) -> int:
    """The step of the final checkpoint of a verify run told to stop at ``stop_step``: the
    ranks stop at the first checkpoint boundary after that step, which a framework's loop can
    put after a later step (Lightning's ``Trainer.fit`` calls the training loader's ``next()``
    for an epoch's first batch from a new iterator, so the boundary due at an epoch's last
    step is the one after the next epoch's first step). The earliest committed checkpoint at
    ``stop_step`` or later; ``stop_step`` when there is none."""
    from cfrun.contract.checkpoints import committed_steps

    later = [s for s in committed_steps(job_dir / "checkpoints") if s >= stop_step]
    return min(later, default=stop_step)


def has_checkpoint(job_dir: Path, step: int) -> bool:
    """Whether the run in ``job_dir`` has its checkpoint of ``step``."""
    from cfrun.contract.jobdir import step_dir_name

    return (job_dir / "checkpoints" / step_dir_name(step)).is_dir()


def run_supervised(cfg: RunConfig, name: str, python_command: str | None = None) -> RunResult:
    """Run ``cfg`` under cfrun's supervisor (this process's main thread) to its end;
    ``python_command``: the ``cfrun verify --launcher python ...`` line (the hint of a
    one-rank script that went distributed under torchrun).

    Raises:
        CfrunError: the run failed (its exit code; the message names the run).
    """
    from cfrun.supervisor.core import Supervisor

    result = RunResult(name, Path(cfg.job_dir))
    t0 = time.monotonic()
    supervisor = Supervisor(cfg, python_command=python_command)
    try:
        code = supervisor.run()
    except CfrunError as e:
        e.args = (f"cfrun verify: the {name} run failed: {e}",)
        raise
    finally:
        result.seconds = time.monotonic() - t0
    if supervisor.signals.taken is not None:  # Ctrl-C, even after the script's end: stop
        code = code or EXIT_PREEMPTED
    result.exit_code = code
    if code != 0:
        raise _RunStopped(name, code)
    return result


class _RunStopped(CfrunError):
    """A verify run ended with a non-zero code without an error of its own (a signal: 75)."""

    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"cfrun verify: the {name} run stopped with exit code {code}; "
                         "nothing was compared")
        self.exit_code = code  # type: ignore[misc]


def plain_run(cfg: RunConfig, root: Path, stop_step: int) -> RunResult:
    """The script without cfrun's runtime (``--against-plain``): launched as cfrun launches it
    (torchrun, or ``python SCRIPT``; the ranks ``--launcher python`` starts itself on one node,
    :mod:`cfrun.supervisor.local_ranks`, stand in for ``torchrun --standalone``, which runs
    the plain one), with only the observer hook (``CFRUN_VERIFY_OBSERVE``,
    :func:`cfrun.rank.verify.observe`), which ends every rank at ``stop_step``.

    Raises:
        JobFailedError: the script failed (exit code 4).
    """
    from cfrun.contract import settings as E
    from cfrun.supervisor.launcher import TORCHRUN_VARIABLES, build_launch_argv, hooks_dir

    out = root / "plain"
    out.mkdir(mode=0o700)
    if cfg.starts_ranks and not cfg.one_python_rank:  # torchrun sets the same variables
        cfg = dataclasses.replace(cfg, launcher="torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "CFRUN_RANK_"))
           and k not in (E.HOOK_OWNER_PID, E.RANK_SETTINGS)}
    if cfg.launcher == "python":
        env = {k: v for k, v in env.items()
               if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks_dir()), env.get("PYTHONPATH", ""))
                                        if p)
    env[E.VERIFY_OBSERVE] = json.dumps({"dir": str(out / V.DIR), "stop_step": stop_step,
                                        "launcher": cfg.launcher})
    argv = build_launch_argv(cfg, log_dir=str(out / "torchrun-logs"))
    result = RunResult("plain", out)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cfg.cwd, start_new_session=True)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:  # Ctrl-C: nothing of the plain run outlives cfrun
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        result.seconds = time.monotonic() - t0
    result.exit_code = code
    if code != 0:
        raise JobFailedError(f"cfrun verify: the plain run (without cfrun) failed with exit "
                             f"code {code}")
    return result
