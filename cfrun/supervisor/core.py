"""The supervisor: owns the job dir, starts torchrun, restarts it after failures, handles signals.

Three parts, as in torch.distributed.elastic's agent: this module's :class:`Supervisor` holds the
job dir's lock, the persist agent and the signal handlers, and loops *monitor -> decide -> act*;
:class:`cfrun.supervisor.monitor.Monitor` runs one torchrun attempt and returns how it ended (an
``Outcome``); :func:`cfrun.supervisor.machine.decide` (pure: no I/O, no clock) turns the outcome
and the history of earlier attempts into the next action (restart after a backoff, or stop with
an exit code). The states and their transitions are documented on
:class:`~cfrun.supervisor.machine.SupervisorState`::

    STARTING -> RUNNING -> SUCCEEDED                 script exited 0
                       -> RESTARTING -> RUNNING      failed, restarts left (backoff in between)
                       -> FAILED                     failed, no restarts left        (exit 4)
                       -> FATAL                      a rank found the resume would be wrong (5)
                       -> PREEMPTED                  SIGTERM/SIGINT/SIGHUP to cfrun   (exit 75)

Signals to cfrun become a ``SignalReceived`` exception on the main thread. The shutdown
(:meth:`Monitor.shutdown`) does not signal torchrun: it writes ``stop_request.json`` with the
grace deadline, the ranks stop at one step, take a final checkpoint if rank 0 decided it fits,
write ``preempted/`` marks and exit 0 (so torchrun does not SIGTERM a rank still finishing). At
the deadline, or at once on a second signal, every rank and the persist agent are SIGKILLed, so
cfrun exits within ``grace_s`` (plus its own exit) and no process outlives it. One ``preempted``
event says which step the job stopped at and whether the final checkpoint was committed.

SIGHUP (a closed terminal, a dropped ssh session) stops the job as SIGTERM does, except when
cfrun is PID 1 (:func:`stop_signals`). SIGUSR1 and SIGUSR2 (as PID 1 also SIGHUP and SIGQUIT)
are passed on to the ranks
(:func:`forwarded_signals`). A supervisor killed by SIGKILL leaves nothing running either
(``cfrun.supervisor.launcher``: a parent-death signal for torchrun and the agent, a reaper for
the rest).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from cfrun import __version__
from cfrun.contract import coordination, early_signals, faults, lifetime, slots
from cfrun.contract import settings as E
from cfrun.contract.checkpoints import committed_steps
from cfrun.contract.config import (
    Identity,
    RunConfig,
    redact_url,
)
from cfrun.contract.jobdir import (
    JobDir,
    atomic_write_json,
)
from cfrun.contract.manifest import FORMAT_VERSION, ManifestKeys
from cfrun.supervisor.admission import Admission, drop_untrained
from cfrun.supervisor.agentproc import AgentProcess
from cfrun.supervisor.console import ConsoleTap
from cfrun.supervisor.launcher import (
    kill_job_processes,
    leftover_agent_pid,
    spawn,
    start_reaper,
)
from cfrun.supervisor.machine import (
    Action,
    ActionKind,
    History,
    Policy,
    SupervisorState,
    decide,
)
from cfrun.supervisor.monitor import Monitor
from cfrun.supervisor.signals import (
    SignalReceived,
    StopSignals,
    forwarded_signals,
    stop_signals,
)
from cfrun.supervisor.standby import Standby, standby_wanted

logger = logging.getLogger("cfrun")


class Supervisor:
    """Runs one job to completion. Construct, then :meth:`run` on the main thread.

    ``spawn_fn`` starts torchrun (tests pass fakes); ``backoff_s`` is the wait before the first
    restart (doubled per restart, at most 30 s); ``accept_changed_command``
    (``--accept-changed-command``) lets a job dir's job go on under a changed command;
    ``rerun`` (``--rerun``) runs a finished job's command again (else it says it finished and
    exits 0); ``python_command``: the command line as typed with ``--launcher python``, the
    hint of a one-rank script that went distributed under torchrun
    (:func:`cfrun.supervisor.machine.went_distributed`); ``default_job_dir``: the job dir is
    the command's default (no ``--job-dir``), so one this run creates is removed again when
    the run trained nothing (:func:`cfrun.supervisor.admission.drop_untrained`)."""

    def __init__(self, cfg: RunConfig, *, spawn_fn: Callable[..., Any] = spawn,
                 backoff_s: float = 0.5, accept_changed_command: bool = False,
                 rerun: bool = False, python_command: str | None = None,
                 default_job_dir: bool = False) -> None:
        self.cfg = cfg
        self.jobdir = JobDir(cfg.job_dir)
        self.default_job_dir = default_job_dir
        self.accept_changed_command = accept_changed_command
        self.rerun = rerun
        self.metrics: Any = None  # JobMetrics once the job runs
        self.metrics_server: Any = None
        self.jobdir_id: tuple[int, int] | None = None
        """The job dir's (device, inode) when its lock was taken."""
        self.identity: Identity | None = None  # the job's (None: cfrun profile)
        self.state = SupervisorState.STARTING
        self.agents = AgentProcess(cfg, self.jobdir)
        """The node's persist agent (:mod:`cfrun.supervisor.agentproc`)."""
        self.reaper: subprocess.Popen[bytes] | None = None
        self.signals = StopSignals(on_second=self._kill_agent)
        """The signal handlers and what they received (:mod:`cfrun.supervisor.signals`)."""
        self.progress_s = (E.get_float(E.PROGRESS_S, minimum=0) or 0.0) \
            if sys.stderr.isatty() else 0.0
        self.policy = Policy.from_config(cfg, backoff_s, python_command)
        self.history = History()
        self.console = ConsoleTap()  # the ranks' output kept in the job dir, once opened
        self.standby = Standby(cfg) if standby_wanted(cfg) else None
        """The warm spare of a ``--launcher python`` rank (:mod:`cfrun.supervisor.standby`)."""
        self.monitor = Monitor(cfg, self.jobdir, spawn_fn=spawn_fn,
                               check_agent=lambda: self._check_agent(),
                               own_processes=lambda: (
                                   self.agent, self.reaper,
                                   *(self.standby.processes() if self.standby else ())),
                               standby=self.standby,
                               second_signal=lambda: self.signals.second,
                               check_stop=self.signals.check,
                               pending_signals=self.signals.pending,
                               progress_s=self.progress_s, console=self.console)

    def _set(self, state: SupervisorState, **fields: Any) -> None:
        self.state = state
        self.jobdir.emit_event("state", state=state.value, **fields)

    def _first_attempt_number(self) -> int:
        """This node's attempts so far (several nodes share events.jsonl)."""
        return sum(1 for e in self.jobdir.read_events() if e.get("event") == "attempt_start"
                   and e.get("node", 0) == self.cfg.node_rank)

    def run(self) -> int:
        """Run until success, preemption, or failure. Returns the exit code.

        Raises:
            BadInputError: the job dir holds a job run with another command (nothing in the
                job dir changed; exit 2).
            JobDirLockedError: another cfrun owns the job dir.
            JobFailedError: restarts ran out (exit 4).
            FatalJobError: a rank reported that resuming would be wrong, or a crash loop (exit 5).
        """
        jd = self.jobdir
        jd.check_usable()
        admission = Admission(self.cfg, jd, accept_changed=self.accept_changed_command,
                              rerun=self.rerun)
        if not self.cfg.profile_only and admission.check():  # reads only
            return 0  # a finished job: nothing to do (said in one line)
        made = [p for p in (jd.root.parent, jd.root) if not p.exists()]  # by this run
        try:  # a read-only or full disk, no permission: one line, exit 2, nothing started
            jd.create()
            jd.lock()
            self.jobdir_id = jd.dir_id()  # re-identified before each attempt (check_same)
            self.identity = admission.take()
            self._write_config()  # before a stop can be reported: `cfrun resume` needs it
        except OSError as e:
            raise jd.unwritable(e) from None
        self._kill_leftovers()
        self.reaper = start_reaper(self.cfg.job_dir, self.cfg.node_rank)
        lifetime.become_subreaper()
        start_delay_s = faults.value("supervisor.start_delay_s")
        if start_delay_s:
            time.sleep(float(start_delay_s))
        old_handlers = {s: signal.signal(s, self.signals.on_stop) for s in stop_signals()}
        old_forward = {s: signal.signal(s, self.signals.queue_forward)
                       for s in forwarded_signals()}
        try:
            held = early_signals.take(old_handlers)  # a stop that came while cfrun was starting
            if held is not None:
                raise SignalReceived(held)
            self._start_agent()
            if E.get_flag(E.CONSOLE_LOG):
                self.console.open()
            if self.standby is not None:
                self.standby.stdio = self.console.popen_kwargs()
            return self._run_locked()
        except SignalReceived as sig:
            return self._preempt(sig)
        finally:
            if self.standby is not None:
                self.standby.stop()
            try:
                # from here on a signal ends at once (on_stop) instead of raising
                self.signals.shutting_down = True
                self._stop_agent()
            except SignalReceived:  # it came before the flag was set
                self.signals.second = True
                self._stop_agent()
            finally:
                for s, h in old_handlers.items():
                    signal.signal(s, h)
                for s, h in old_forward.items():
                    signal.signal(s, h)
                if self.metrics is not None:
                    self.metrics.write_textfile()
                if self.metrics_server is not None:
                    self.metrics_server.shutdown()
                self.console.close()
                jd.unlock()
                self._stop_reaper()
                if made and self.default_job_dir:
                    drop_untrained(jd, self.cfg, self.state, made)

    def _start_metrics(self) -> None:
        """Metrics (:mod:`cfrun.supervisor.metrics`): ``metrics.prom`` written by the monitor
        every few seconds and at the end; with ``--metrics`` also served over HTTP. A port that
        cannot be bound is one warning, not a failed job."""
        from cfrun.supervisor.metrics import JobMetrics, serve

        self.metrics = JobMetrics(self.jobdir.root, live=True)
        self.monitor.metrics = self.metrics
        if self.cfg.metrics:
            try:
                self.metrics_server, port = serve(self.metrics, self.cfg.metrics)
            except OSError as e:
                logger.warning("cfrun: cannot serve metrics at %s (%s); metrics.prom in the "
                               "job dir has them", self.cfg.metrics, e.strerror or e)
            else:
                host = self.cfg.metrics.rpartition(":")[0]
                logger.info("cfrun: metrics at http://%s:%d/metrics", host, port)

    def _kill_leftovers(self) -> None:
        """With the lock held: kill what a dead supervisor of this job dir (this node) left.

        A persist agent still answering on the job's socket, and torchrun, ranks and workers
        marked with this job dir (cfrun.supervisor.launcher.job_processes), would go on writing
        into the job dir and keep the new agent from binding its socket. Logged and recorded as a
        ``leftovers_killed`` event."""
        import psutil

        pids = []
        agent_pid = leftover_agent_pid(self.cfg.job_dir)
        if agent_pid is not None and agent_pid != os.getpid():
            try:
                agent = psutil.Process(agent_pid)
                agent.kill()
                psutil.wait_procs([agent], timeout=5)
                pids.append(agent_pid)
            except psutil.Error:
                pass
        slots.remove_dirs(self.cfg.job_dir)  # slots of a dead supervisor's ranks
        pids += kill_job_processes(self.cfg.job_dir, self.cfg.node_rank,
                                   exclude_supervisor_pid=os.getpid())
        if pids:
            logger.warning("cfrun: killed %d leftover process(es) of a cfrun that died on this "
                           "job dir (pids %s)", len(pids), ", ".join(map(str, sorted(pids))))
            self.jobdir.emit_event("leftovers_killed", pids=sorted(pids),
                                   agent_pid=agent_pid)

    def _stop_reaper(self) -> None:
        """Close the reaper's pipe (it kills what is left of this run, none normally) and wait."""
        reaper, self.reaper = self.reaper, None
        if reaper is None:
            return
        try:
            if reaper.stdin is not None:
                reaper.stdin.close()
            reaper.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            reaper.kill()
            reaper.wait()

    def _kill_agent(self) -> None:
        """A second stop signal: the persist agent goes at once (the ranks follow)."""
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()

    def _preempt(self, sig: SignalReceived) -> int:
        """SIGTERM/SIGINT: stop the ranks and the agent within ``grace_s``, then report the
        final checkpoint (or its absence). Returns ``EXIT_PREEMPTED``."""
        deadline_s = time.monotonic() + self.cfg.grace_s  # monotonic seconds
        self.signals.take()
        self.monitor.shutdown(sig.signum, deadline_s)
        self._stop_agent(deadline_s)
        action = decide(self.monitor.stopped(str(sig)), self.history, self.policy)
        self._act(action)  # a stop: no backoff
        return action.exit_code

    def _run_locked(self) -> int:
        """The loop: monitor one attempt, decide, act, until an action stops the job."""
        jd = self.jobdir
        self._start_metrics()
        for stale in coordination.STALE_AT_START:
            (jd.root / stale).unlink(missing_ok=True)
        attempt = self._first_attempt_number()
        while True:
            self.signals.check()
            if self.jobdir_id is not None:
                jd.check_same(self.jobdir_id)  # the ranks load from it next
            steps = committed_steps(jd.checkpoints)
            self._set(SupervisorState.RUNNING, attempt=attempt,
                      resume_step=steps[0] if steps else None)
            outcome = self.monitor.run(attempt)
            if self.jobdir_id is not None:  # and after it: a swap while the ranks started
                jd.check_same(self.jobdir_id)  # stops the job (exit 5), not a restart
            action = decide(outcome, self.history, self.policy)
            self.history = self.history.then(outcome, action)
            code = self._act(action)
            if code is not None:
                return code
            attempt = action.attempt

    def _write_config(self) -> None:
        """``config.json``: the run's settings, versions, identity and this supervisor's
        liveness (what ``cfrun resume`` and ``cfrun status`` read)."""
        cfg_json = {**self.cfg.to_json(), "cfrun_version": __version__,
                    "format_version": FORMAT_VERSION, **self._liveness()}
        cfg_json["persist_to"] = redact_url(self.cfg.persist_to)  # no password on disk
        if self.identity is not None:
            cfg_json.update(job_id=self.identity.job_id, job_name=self.identity.job_name,
                            command_fingerprint=self.identity.command.fingerprint,
                            command_changes=list(self.identity.changes))
        atomic_write_json(self.jobdir.config_path, cfg_json)

    @staticmethod
    def _liveness() -> dict[str, Any]:
        """``supervisor_pid`` and its start time (``supervisor_start_s``, psutil's
        ``create_time``): ``cfrun status`` tells a live supervisor from a dead one by them."""
        import psutil

        return {"supervisor_pid": os.getpid(),
                "supervisor_start_s": psutil.Process().create_time()}

    def _act(self, action: Action) -> int | None:
        """Carry out ``action``: its events, its report lines (warnings), the state; then
        wait out a restart's backoff (returns None), or return a stop's exit code.

        Raises:
            JobFailedError, FatalJobError: the stop is a failure (exit 4, 5).
        """
        for kind, fields in action.events:
            self.jobdir.emit_event(kind, **fields)
        for line in action.reports:
            logger.warning("%s", line)
        self._set(action.state, **action.state_fields)
        if action.kind is ActionKind.RESTART:
            self._backoff_wait(action.backoff_s)
            return None
        error = action.exception()
        if error is not None:
            raise error
        return action.exit_code

    def _backoff_wait(self, delay_s: float) -> None:
        """Wait ``delay_s`` seconds before a restart, reaping orphans meanwhile (PID 1)."""
        deadline = time.monotonic() + delay_s
        while (left_s := deadline - time.monotonic()) > 0:
            time.sleep(min(left_s, 0.1))
            self.signals.check()
            self.monitor.reap_orphans()

    # ------------------------------------------------------------------ persist agent

    @property
    def agent(self) -> subprocess.Popen[bytes] | None:
        """The persist agent's process (:class:`cfrun.supervisor.agentproc.AgentProcess`)."""
        return self.agents.proc

    def _start_agent(self) -> None:
        """:meth:`AgentProcess.start` for this job's identity; the ranks get the job dir's
        manifest keys (the MAC they check at resume; issue 32, finding 4) and identity."""
        key = self.agents.start(self.identity)
        self.monitor.manifest_keys = ManifestKeys.of_job_key(key).to_hex()
        self.monitor.job_dir_id = self.jobdir_id

    def _check_agent(self) -> None:
        """:meth:`AgentProcess.check`: restart the agent if it died."""
        self.agents.check(self.identity)

    def _stop_agent(self, deadline_s: float | None = None) -> None:
        """:meth:`AgentProcess.stop`, at once after a second signal."""
        self.agents.stop(deadline_s, second_signal=self.signals.second)
