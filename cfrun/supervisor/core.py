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
from pathlib import Path
from typing import Any

from cfrun import __version__
from cfrun.contract import coordination, early_signals, faults, ipc, slots
from cfrun.contract import settings as E
from cfrun.contract.checkpoints import committed_steps, is_final
from cfrun.contract.config import (
    ACCEPTED,
    FINISHED,
    Command,
    Identity,
    RunConfig,
    WorldSizeRefusedError,
    check_identity,
    redact_url,
    resume_command,
)
from cfrun.contract.errors import (
    BadInputError,
    ChangedCommandError,
    FatalJobError,
    JobDirLockedError,
)
from cfrun.contract.jobdir import (
    FOREIGN_PREFIX,
    PREVIOUS_CHECKPOINTS_PREFIX,
    JobDir,
    atomic_write_json,
    step_dir_name,
)
from cfrun.contract.jobkey import ensure_job_key
from cfrun.contract.manifest import FORMAT_VERSION, ManifestKeys, read_manifest
from cfrun.supervisor.launcher import (
    die_with_parent,
    kill_job_processes,
    leftover_agent_pid,
    module_argv,
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
from cfrun.supervisor.machine import describe_returncode as _describe
from cfrun.supervisor.monitor import Monitor

logger = logging.getLogger("cfrun")


def forwarded_signals() -> tuple[signal.Signals, ...]:
    """Signals cfrun passes on to the ranks: SIGUSR1 and SIGUSR2 always; SIGHUP and SIGQUIT too
    when cfrun is PID 1 (a container's entrypoint), where the kernel would otherwise drop them
    (elsewhere they end cfrun, and with it every process of the job, as for any program)."""
    sigs = [signal.SIGUSR1, signal.SIGUSR2]
    if os.getpid() == 1:
        sigs += [signal.SIGHUP, signal.SIGQUIT]
    return tuple(sigs)


def stop_signals() -> tuple[signal.Signals, ...]:
    """Signals that stop the job as a preemption (final checkpoint, exit 75, resumable):
    SIGTERM, SIGINT, and SIGHUP (a closed terminal, a dropped ssh session) unless cfrun is
    PID 1, where SIGHUP is passed on to the ranks (:func:`forwarded_signals`)."""
    sigs = [signal.SIGTERM, signal.SIGINT]
    if os.getpid() != 1:
        sigs.append(signal.SIGHUP)
    return tuple(sigs)


def _become_subreaper() -> None:
    """PR_SET_CHILD_SUBREAPER: orphaned descendants (ranks of a dead torchrun) become ours."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _lock_held(path: Path) -> bool:
    """True when a live process holds the job dir's lock at ``path``; probed with a shared
    ``flock`` on a read-only descriptor, so the file is neither created nor truncated."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


class SignalReceived(BaseException):
    """A stop signal (:func:`stop_signals`) arrived; ``signum`` says which.

    A ``BaseException``, as ``KeyboardInterrupt`` is: the handler raises it wherever the main
    thread is, and code that catches ``Exception`` there must not swallow the stop. A logging
    handler does (``Handler.emit`` reports an exception of its own and goes on): a SIGTERM that
    landed while the supervisor logged an attempt's start was lost, and the job ran to its end
    (a fault storm on a loaded machine)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def dry_run_outcome(cfg: RunConfig, *, accept_changed_command: bool = False,
                    rerun: bool = False) -> str:
    """What a run of ``cfg`` would do with its job dir, for ``cfrun --dry-run`` (issue 27,
    item 8): ``new``, ``resume from step N``, ``start over`` (no checkpoint), ``finished``
    (nothing to do), ``refused`` (a changed command, exit 2) or ``locked`` (exit 3), with the
    reason. Reads only, as :meth:`Supervisor.run` decides before it writes anything."""
    jd = JobDir(cfg.job_dir)
    if not jd.root.exists():
        return "new: the job dir does not exist yet; the job starts at step 0"
    steps = committed_steps(jd.checkpoints)
    try:
        _, changes, _ = check_identity(
            jd.identity_path, Command.of(cfg), job_name=cfg.job_name,
            accept_changed=accept_changed_command, nnodes=cfg.nnodes, resumable=bool(steps),
            reshard=cfg.reshard)
    except BadInputError as e:
        fresh = finished_changed(jd, cfg, e)
        if fresh is not None:
            return (f"start at step 0: the job finished {fresh} and its command changed; its "
                    f"checkpoints would be moved to {jd.root / PREVIOUS_CHECKPOINTS_PREFIX}"
                    "<UTC time>")
        return f"refused (exit 2): {e}"
    except WorldSizeRefusedError as e:
        return f"refused (exit 5): {e}"
    finished = None if changes or rerun else finished_at(jd, cfg.node_rank)
    if finished is not None:
        return f"finished {finished}: nothing to do (exit 0; --rerun runs it again)"
    if _lock_held(jd.lock_path):
        return "locked (exit 3): another cfrun runs this job"
    resumable = [s for s in steps if not is_final(jd.checkpoints / step_dir_name(s))]
    if resumable:  # a resume never starts from the final checkpoint (issue 27, item 2)
        why = " (changed command accepted)" if changes else ""
        try:
            saved = read_manifest(jd.checkpoints / step_dir_name(resumable[0])).world_size
        except Exception:  # unreadable: the ranks judge it
            saved = None
        world = cfg.nproc_per_node * cfg.nnodes
        if saved is not None and saved != world:
            why = (f" resharded from {saved} to {world} ranks (--reshard; not bit-exact)"
                   if cfg.reshard else "")
            if not cfg.reshard:
                return (f"refused (exit 5): checkpoint step {resumable[0]} was written by "
                        f"{saved} ranks and this run has {world}; add --reshard")
        return f"resume from the checkpoint of step {resumable[0]}" + why
    return "start at step 0: the job dir holds no checkpoint"


def finished_changed(jd: JobDir, cfg: RunConfig, refusal: BadInputError) -> str | None:
    """``"at step N on DATE"`` where ``refusal`` refused a changed command (the script edited,
    other arguments) in the job dir of a job that finished (:func:`finished_at`) on one node,
    and no ``--accept-changed-command`` asked to go on from its checkpoints: such a run starts
    over, from step 0, with the finished run's checkpoints set aside (issue 37, item 2). None:
    the refusal stands (an unfinished job's checkpoints are work to go on from). Reads only."""
    if not isinstance(refusal, ChangedCommandError) or cfg.nnodes != 1:
        return None
    return finished_at(jd, cfg.node_rank)


def finished_at(jd: JobDir, node_rank: int) -> str | None:
    """``"at step N on DATE"`` when this node's last attempt of the job in ``jd`` succeeded
    (its last ``state`` event is ``succeeded`` and no attempt started since) and the job
    committed a checkpoint, else None: a run that never committed one (``cfrun profile``, a
    script's ``-h``) did no training to protect, so its command runs again.

    The step is the newest any rank's heartbeat reached (the script's end), else the newest
    committed checkpoint; the date is the event's, in UTC. Reads only; never raises for a
    missing or unreadable events file (None).
    """
    last_state: dict[str, Any] | None = None
    if not committed_steps(jd.checkpoints):
        return None
    try:
        events = jd.read_events()
    except Exception:  # unreadable: not known to be finished
        return None
    for e in events:
        if e.get("node", 0) != node_rank:
            continue
        if e.get("event") == "state":
            last_state = e
        elif e.get("event") == "attempt_start":
            last_state = None
    if last_state is None or last_state.get("state") != SupervisorState.SUCCEEDED.value:
        return None
    beat = coordination.newest_heartbeat_step(jd.root)
    steps = [beat] if beat is not None else committed_steps(jd.checkpoints)[:1]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(last_state.get("t_unix_s",
                                                                                   0))))
    return f"at step {max(steps)} on {when}" if steps else f"on {when}"


class Supervisor:
    """Runs one job to completion. Construct, then :meth:`run` on the main thread.

    ``spawn_fn`` starts torchrun (tests pass fakes); ``backoff_s`` is the wait before the first
    restart (doubled per restart, at most 30 s); ``accept_changed_command``
    (``--accept-changed-command``) lets a job dir's job go on under a changed command;
    ``rerun`` (``--rerun``) runs a finished job's command again (else it says it finished and
    exits 0); ``python_command``: the command line as typed with ``--launcher python``, the
    hint of a one-rank script that went distributed under torchrun
    (:func:`cfrun.supervisor.machine.went_distributed`)."""

    def __init__(self, cfg: RunConfig, *, spawn_fn: Callable[..., Any] = spawn,
                 backoff_s: float = 0.5, accept_changed_command: bool = False,
                 rerun: bool = False, python_command: str | None = None) -> None:
        self.cfg = cfg
        self.jobdir = JobDir(cfg.job_dir)
        self.accept_changed_command = accept_changed_command
        self.rerun = rerun
        self.metrics: Any = None  # JobMetrics once the job runs
        self.metrics_server: Any = None
        self.jobdir_id: tuple[int, int] | None = None
        """The job dir's (device, inode) when its lock was taken."""
        self.identity: Identity | None = None  # the job's (None: cfrun profile)
        self.state = SupervisorState.STARTING
        self.agent: subprocess.Popen[bytes] | None = None
        self.slot_dir: Path | None = None  # the job's private slot directory (contract.slots)
        self.reaper: subprocess.Popen[bytes] | None = None
        self._shutting_down = False
        self._second_signal = False
        self.progress_s = (E.get_float(E.PROGRESS_S, minimum=0) or 0.0) \
            if sys.stderr.isatty() else 0.0
        self._pending_signals: list[int] = []
        self.policy = Policy.from_config(cfg, backoff_s, python_command)
        self.history = History()
        self.monitor = Monitor(cfg, self.jobdir, spawn_fn=spawn_fn,
                               check_agent=lambda: self._check_agent(),
                               own_processes=lambda: (self.agent, self.reaper),
                               second_signal=lambda: self._second_signal,
                               pending_signals=self._pending_signals,
                               progress_s=self.progress_s)

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
        identity: Identity | None = None
        changes: list[str] = []
        write = False
        fresh: str | None = None  # a finished job whose command changed: "at step N on DATE"
        if not self.cfg.profile_only:  # reads only: a refused command changes nothing
            command = Command.of(self.cfg)
            try:
                identity, changes, write = check_identity(
                    jd.identity_path, command, job_name=self.cfg.job_name,
                    accept_changed=self.accept_changed_command, nnodes=self.cfg.nnodes,
                    resumable=bool(committed_steps(jd.checkpoints)), reshard=self.cfg.reshard)
            except BadInputError as e:
                if _lock_held(jd.lock_path):  # the job runs: that is the news (exit 3)
                    raise JobDirLockedError(
                        f"job dir {str(jd.root)!r} is in use by another cfrun") from None
                fresh = finished_changed(jd, self.cfg, e)
                if fresh is None:
                    raise
                identity, changes, write = check_identity(
                    jd.identity_path, command, job_name=self.cfg.job_name, accept_changed=False,
                    nnodes=self.cfg.nnodes, resumable=False, why=FINISHED)
            finished = None if changes or self.rerun else finished_at(jd, self.cfg.node_rank)
            if finished is not None:
                resumable = [s for s in committed_steps(jd.checkpoints)
                             if not is_final(jd.checkpoints / step_dir_name(s))]
                rerun_from = f"from its checkpoint of step {resumable[0]}" if resumable \
                    else "from step 0"
                logger.info("cfrun: job %s finished %s; nothing to do. An edited script or "
                            "other arguments start a new run (its checkpoints kept aside), so "
                            "does a new --job-dir; to run it again %s: %s", jd.root, finished,
                            rerun_from, resume_command(jd.root, self.cfg.node_rank, "--rerun"))
                return 0
        try:  # a read-only or full disk, no permission: one line, exit 2, nothing started
            jd.create()
            jd.lock()
            self.jobdir_id = jd.dir_id()  # re-identified before each attempt (check_same)
            previous = self._start_over(fresh, changes) if fresh is not None else None
            if identity is not None:
                self._take_identity(identity, changes, write, previous)
            self._write_config()  # before a stop can be reported: `cfrun resume` needs it
        except OSError as e:
            raise jd.unwritable(e) from None
        self._kill_leftovers()
        self.reaper = start_reaper(self.cfg.job_dir, self.cfg.node_rank)
        _become_subreaper()
        start_delay_s = faults.value("supervisor.start_delay_s")
        if start_delay_s:
            time.sleep(float(start_delay_s))
        old_handlers = {s: signal.signal(s, self._on_signal) for s in stop_signals()}
        old_forward = {s: signal.signal(s, self._queue_forward) for s in forwarded_signals()}
        try:
            held = early_signals.take(old_handlers)  # a stop that came while cfrun was starting
            if held is not None:
                raise SignalReceived(held)
            self._start_agent()
            return self._run_locked()
        except SignalReceived as sig:
            return self._preempt(sig)
        finally:
            try:
                # from here on a signal ends at once (_on_signal) instead of raising
                self._shutting_down = True
                self._stop_agent()
            except SignalReceived:  # it came before the flag was set
                self._second_signal = True
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
                jd.unlock()
                self._stop_reaper()

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

    def _start_over(self, finished: str, changes: list[str]) -> Path:
        """With the lock held: a finished job's command changed (``finished``: when it
        finished). Its ``checkpoints/`` go aside (:meth:`JobDir.set_aside_checkpoints`), its
        heartbeats (the old run's steps) are removed, and one line says so; returns where the
        checkpoints went."""
        previous = self.jobdir.set_aside_checkpoints()
        for hb in coordination.heartbeat_paths(self.jobdir.root):
            hb.unlink(missing_ok=True)
        logger.info("cfrun: job %s finished %s and its command changed (%s): a new run starts "
                    "at step 0; the finished run's checkpoints are kept in %s", self.jobdir.root,
                    finished, "; ".join(changes), previous)
        return previous

    def _take_identity(self, identity: Identity, changes: list[str], write: bool,
                       previous: Path | None = None) -> None:
        """With the lock held: record the job's identity (new, or a change accepted with
        ``--accept-changed-command``: a ``command_changed`` event and a warning; or a finished
        job started over, its checkpoints set aside in ``previous``: the event) and set aside
        checkpoints of another job found in ``checkpoints/`` (never resumed from)."""
        self.identity = identity
        if write:
            atomic_write_json(self.jobdir.identity_path, identity.to_json())
        if changes:
            why = identity.changes[-1].get("why", ACCEPTED)
            if previous is None:  # a started-over job said so already (_start_over)
                logger.warning("cfrun: going on with a changed command (%s): %s", why,
                               "; ".join(changes))
            self.jobdir.emit_event(
                "command_changed", changed=changes, fingerprint=identity.command.fingerprint,
                why=why, **({"previous_checkpoints": str(previous)} if previous else {}))
        self._set_aside_foreign(identity)

    def _set_aside_foreign(self, identity: Identity) -> None:
        """Move committed checkpoints whose manifest names another job id aside
        (``foreign-step-N-<ms>``), with a ``foreign_checkpoint`` event each. Checkpoints without
        a job id (an older cfrun wrote them into this job dir) stay."""
        checkpoints = self.jobdir.checkpoints
        for step in committed_steps(checkpoints):
            src = checkpoints / step_dir_name(step)
            try:
                job_id = read_manifest(src).meta.get("job_id")
            except Exception:  # an unreadable one is the resume's to judge and set aside
                continue
            if job_id is None or identity.owns(job_id):
                continue
            dst = checkpoints / f"{FOREIGN_PREFIX}{src.name}-{int(time.time() * 1000)}"
            try:
                os.rename(src, dst)
            except FileNotFoundError:  # another node's supervisor moved it
                continue
            except OSError as e:
                raise FatalJobError(f"checkpoint {src} is another job's (job id {job_id}) and "
                                    f"cannot be moved aside ({e.strerror}); remove it") from None
            logger.warning("cfrun: %s is another job's checkpoint (job id %s, this job %s); "
                           "moved aside to %s, never resumed from", src, job_id,
                           identity.job_id, dst.name)
            self.jobdir.emit_event("foreign_checkpoint", step=step, job_id=str(job_id),
                                   path=str(dst))

    def _queue_forward(self, signum: int, frame: Any) -> None:
        """Handler of :func:`forwarded_signals`: forwarded by the attempt's loop (≤ 0.1 s)."""
        self._pending_signals.append(signum)

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

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._shutting_down:  # a second signal: end at once, leave nothing behind
            self._second_signal = True
            if self.agent is not None and self.agent.poll() is None:
                self.agent.kill()
            return
        self._shutting_down = True  # set before raising: a signal from now on is the second
        raise SignalReceived(signum)

    def _preempt(self, sig: SignalReceived) -> int:
        """SIGTERM/SIGINT: stop the ranks and the agent within ``grace_s``, then report the
        final checkpoint (or its absence). Returns ``EXIT_PREEMPTED``."""
        deadline_s = time.monotonic() + self.cfg.grace_s  # monotonic seconds
        self._shutting_down = True
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
            self.monitor.reap_orphans()

    # ------------------------------------------------------------------ persist agent

    def _start_agent(self) -> None:
        """Start the node's persist agent (its own process group: it outlives rank restarts;
        it is SIGKILLed when the supervisor dies). Main thread only (PR_SET_PDEATHSIG).

        Each start gets a new random socket name; the agent is in service once the process
        answering there is the one started (pid and uid, ``SO_PEERCRED``) and ``agent.json``
        names it. If another process answers (it took the name first), that is said in one
        line, the agent is stopped and started again under a new name (3 tries).

        Raises:
            FatalJobError: no agent came up.
            BadInputError: ``--job-key-file`` is not this job dir's key.
        """
        # every job dir has its own job.key: its manifests carry a MAC under it, which the
        # ranks check at resume (issue 32, finding 4); with --peer and no --job-key-file, seals
        # at the peer and level 2 are under the token (an older cfrun's job.key still counts)
        key = ensure_job_key(self.jobdir.root, self.cfg.job_key_file)
        self.monitor.manifest_keys = ManifestKeys.of_job_key(key).to_hex()
        self.monitor.job_dir_id = self.jobdir_id
        if self.slot_dir is None:
            self.slot_dir = slots.create_dir(self.cfg.job_dir)
        for _ in range(3):
            address = ipc.new_agent_address()
            if self._launch_agent(address):
                return
            if self.agent is not None and self.agent.poll() is None:
                self.agent.kill()
                self.agent.wait()
        raise FatalJobError("the persist agent did not start (see its output above)")

    def _launch_agent(self, address: str) -> bool:
        """Start an agent at ``address``; True once it answers there and ``agent.json`` names
        it, False if it died or another process answers."""
        argv = [*module_argv("cfrun.agent"), "--job-dir", str(Path(self.cfg.job_dir).absolute()),
                "--keep", str(self.cfg.keep),
                "--world-size", str(self.cfg.nnodes * self.cfg.nproc_per_node)]
        # the address and the level-2 URL (it may hold a password) go in the environment,
        # which only this user reads: a command line is every user's (/proc/PID/cmdline), and
        # a local user who read the address there bound it first (issue 24, items 5 and 7)
        env = {**os.environ, E.AGENT_ADDRESS: address}
        env.pop(E.PERSIST_TO, None)
        if self.slot_dir is not None:
            argv += ["--slot-dir", str(self.slot_dir)]
        if self.cfg.peer:
            argv += ["--peer", self.cfg.peer, "--peer-token-file", str(self.cfg.peer_token_file),
                     "--peer-streams", str(self.cfg.peer_streams)]
            if self.cfg.job_key_file:
                argv += ["--per-job-key"]  # ensured in the job dir's job.key
        if self.identity is not None:
            argv += ["--peer-job", self.identity.job_name]
        if self.cfg.persist_to:
            env[E.PERSIST_TO] = self.cfg.persist_to
        if self.cfg.nnodes > 1:
            argv += ["--nnodes", str(self.cfg.nnodes), "--node-rank", str(self.cfg.node_rank),
                     "--local-world-size", str(self.cfg.nproc_per_node)]
        # dies with the supervisor: a SIGKILLed cfrun leaves no agent holding the socket
        self.agent = subprocess.Popen(argv, start_new_session=True, cwd="/",  # not the user's
                                      env=env, preexec_fn=die_with_parent())
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and self.agent.poll() is None:
            try:
                ipc.connect(self.cfg.job_dir, timeout_s=1.0, address=address,
                            expect_pid=self.agent.pid).close()
            except ipc.RefusedPeer:
                return False  # another process answers there (said in one line)
            except OSError:
                time.sleep(0.05)
                continue
            try:
                if ipc.read_agent_record(self.cfg.job_dir).pid == self.agent.pid:
                    return True
            except OSError:
                pass  # not written yet (or an old one)
            time.sleep(0.05)
        return False

    def _check_agent(self) -> None:
        """Restart the agent if it died; ranks reconnect at their next checkpoint."""
        if self.agent is None or self.agent.poll() is None:
            return
        rc = self.agent.returncode
        logger.warning("cfrun: the persist agent died (%s); restarting it", _describe(rc))
        self.jobdir.emit_event("agent_restart", returncode=rc)
        self._start_agent()

    def _stop_agent(self, deadline_s: float | None = None) -> None:
        """Let the agent finish queued persists (SIGTERM), then make sure it is gone.

        ``deadline_s`` (monotonic seconds; preemption): SIGKILL it if it is still running
        then; an unfinished checkpoint stays uncommitted (staging is never visible). After a
        second signal it is killed at once; otherwise it gets 120 s.
        """
        agent = self.agent
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            if self._second_signal:
                wait_s = 0.0
            elif deadline_s is not None:
                wait_s = max(0.0, deadline_s - time.monotonic())
            else:
                wait_s = 120.0
            try:
                agent.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                if deadline_s is not None and not self._second_signal:
                    logger.warning("cfrun: the persist agent did not finish by the grace "
                                   "deadline; killed it (what it was writing is not committed)")
                agent.kill()
                try:
                    agent.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
        self.agent = None
        slots.remove_dirs(self.jobdir.root)
        self.slot_dir = None
