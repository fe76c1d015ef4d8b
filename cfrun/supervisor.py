"""The supervisor: owns the job dir, starts torchrun, restarts it after failures, handles signals.

States (``SupervisorState``)::

    STARTING -> RUNNING -> SUCCEEDED                 script exited 0
                       -> RESTARTING -> RUNNING      failed, restarts left (backoff in between)
                       -> FAILED                     failed, no restarts left        (exit 4)
                       -> FATAL                      a rank found the resume would be wrong (5)
                       -> PREEMPTED                  SIGTERM/SIGINT to cfrun          (exit 75)

Signals to cfrun become a ``SignalReceived`` exception on the main thread; the shutdown forwards
SIGTERM to torchrun's process group, waits ``grace_s``, then SIGKILLs the group (as
torch.distributed.elastic's ``close()``), so no process outlives cfrun.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cfrun import __version__, ipc
from cfrun.checkpoint import committed_steps
from cfrun.config import RunConfig
from cfrun.errors import (
    EXIT_PREEMPTED,
    EXIT_SUCCESS,
    FatalJobError,
    JobFailedError,
)
from cfrun.format import FORMAT_VERSION
from cfrun.jobdir import JobDir, atomic_write_json
from cfrun.launcher import build_torchrun_argv, build_worker_env, spawn
from cfrun.snapshot import remove_slots

logger = logging.getLogger("cfrun")


class SupervisorState(str, enum.Enum):
    """Where the supervisor is; the module docstring lists the transitions."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    FATAL = "fatal"
    PREEMPTED = "preempted"


class SignalReceived(Exception):
    """SIGTERM or SIGINT arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class AttemptResult:
    """How one torchrun attempt ended."""

    attempt: int
    returncode: int
    duration_s: float


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class Supervisor:
    """Runs one job to completion. Construct, then :meth:`run` on the main thread."""

    def __init__(self, cfg: RunConfig, *, spawn_fn: Callable[..., Any] = spawn,
                 backoff_s: float = 0.5) -> None:
        self.cfg = cfg
        self.jobdir = JobDir(cfg.job_dir)
        self.state = SupervisorState.STARTING
        self.spawn_fn = spawn_fn
        self.backoff_s = backoff_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None

    def _set(self, state: SupervisorState, **fields: Any) -> None:
        self.state = state
        self.jobdir.emit_event("state", state=state.value, **fields)

    def _first_attempt_number(self) -> int:
        return sum(1 for e in self.jobdir.read_events() if e.get("event") == "attempt_start")

    def run(self) -> int:
        """Run until success, preemption, or failure. Returns the exit code.

        Raises:
            JobDirLockedError: another cfrun owns the job dir.
            JobFailedError: restarts ran out (exit 4).
            FatalJobError: a rank reported that resuming would be wrong (exit 5).
        """
        jd = self.jobdir
        jd.check_usable()
        jd.create()
        jd.lock()
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start_agent()
            return self._run_locked()
        except SignalReceived as sig:
            self._shutdown(sig.signum)
            self._set(SupervisorState.PREEMPTED, signal=str(sig))
            logger.warning("cfrun: stopped by %s; resume with: cfrun resume %s", sig,
                           self.cfg.job_dir)
            return EXIT_PREEMPTED
        finally:
            try:
                self._stop_agent()
            finally:
                for s, h in old_handlers.items():
                    signal.signal(s, h)
                jd.unlock()

    def _on_signal(self, signum: int, frame: Any) -> None:
        raise SignalReceived(signum)

    def _run_locked(self) -> int:
        jd = self.jobdir
        cfg_json = {**self.cfg.to_json(), "cfrun_version": __version__,
                    "format_version": FORMAT_VERSION}
        atomic_write_json(jd.config_path, cfg_json)
        (jd.root / "fatal.json").unlink(missing_ok=True)
        attempt = self._first_attempt_number()
        restarts = 0
        while True:
            steps = committed_steps(jd.checkpoints)
            self._set(SupervisorState.RUNNING, attempt=attempt,
                      resume_step=steps[0] if steps else None)
            result = self._run_attempt(attempt)
            jd.emit_event("attempt_end", attempt=attempt, returncode=result.returncode,
                          duration_s=round(result.duration_s, 3))
            if result.returncode == 0:
                self._set(SupervisorState.SUCCEEDED, attempt=attempt)
                return EXIT_SUCCESS
            fatal = jd.root / "fatal.json"
            if fatal.exists():
                message = json.loads(fatal.read_text()).get("message", "unknown")
                self._set(SupervisorState.FATAL, attempt=attempt, message=message)
                raise FatalJobError(message)
            cause = _describe(result.returncode)
            if restarts >= self.cfg.max_restarts:
                self._set(SupervisorState.FAILED, attempt=attempt, cause=cause)
                raise JobFailedError(
                    f"the script failed ({cause}) and --max-restarts {self.cfg.max_restarts} "
                    "restarts are used up",
                    hint=f"fix the cause, then continue with: cfrun resume {self.cfg.job_dir}")
            restarts += 1
            attempt += 1
            logger.warning("cfrun: training failed (%s); restart %d of %d from the newest "
                           "checkpoint", cause, restarts, self.cfg.max_restarts)
            self._set(SupervisorState.RESTARTING, attempt=attempt, cause=cause, restart=restarts)
            time.sleep(min(self.backoff_s * (2 ** (restarts - 1)), 30.0))

    def _run_attempt(self, attempt: int) -> AttemptResult:
        argv = build_torchrun_argv(self.cfg)
        env = build_worker_env(self.cfg, attempt)
        self.jobdir.emit_event("attempt_start", attempt=attempt, argv=argv)
        t0 = time.monotonic()
        self.proc = self.spawn_fn(argv, env, self.cfg.cwd)
        while True:
            try:
                rc = self.proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                self._check_agent()
        try:  # stragglers of the attempt (workers of a killed rank): none may outlive it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None
        return AttemptResult(attempt, rc, time.monotonic() - t0)

    # ------------------------------------------------------------------ persist agent

    def _start_agent(self) -> None:
        """Start the node's persist agent (its own process group: it outlives rank restarts)."""
        argv = [sys.executable, "-m", "cfrun.agent", "--job-dir", self.cfg.job_dir,
                "--keep", str(self.cfg.keep)]
        self.agent = subprocess.Popen(argv, start_new_session=True)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and self.agent.poll() is None:
            try:
                ipc.connect(self.cfg.job_dir, timeout_s=1.0).close()
                return
            except OSError:
                time.sleep(0.05)
        raise FatalJobError("the persist agent did not start (see its output above)")

    def _check_agent(self) -> None:
        """Restart the agent if it died; ranks reconnect at their next checkpoint."""
        if self.agent is None or self.agent.poll() is None:
            return
        rc = self.agent.returncode
        logger.warning("cfrun: the persist agent died (%s); restarting it", _describe(rc))
        self.jobdir.emit_event("agent_restart", returncode=rc)
        self._start_agent()

    def _stop_agent(self) -> None:
        """Let the agent finish queued persists (SIGTERM), then make sure it is gone."""
        agent, self.agent = self.agent, None
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=120)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        remove_slots(self.jobdir.root)

    def _shutdown(self, signum: int) -> None:
        """SIGTERM the torchrun process group, wait ``grace_s``, then SIGKILL it."""
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + self.cfg.grace_s
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                continue
            except SignalReceived:  # a second signal: end at once
                break
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
