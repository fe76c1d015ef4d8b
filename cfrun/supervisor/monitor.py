"""The monitor: runs one torchrun attempt and says how it ended, as an :class:`Outcome`.

:meth:`Monitor.run` spawns torchrun, then waits for it in 0.1 s steps: it forwards queued
signals to the ranks, prints the progress line, and every ``HOUSEKEEPING_S`` checks the persist
agent, reaps orphans and looks at the heartbeats (a hang gets the ranks killed). When torchrun
is gone it kills what is left of the attempt and reads what the ranks left behind (``errors/``,
``ended/``, ``preempted/`` marks, ``fatal.json``, heartbeats, committed checkpoints, the OOM-kill
counter) into the :class:`~cfrun.supervisor.machine.Outcome` that the pure policy
(:func:`cfrun.supervisor.machine.decide`) decides on. On a preemption the supervisor calls
:meth:`Monitor.shutdown` (stop the ranks by the grace deadline), then :meth:`Monitor.stopped`.

Runs in the supervisor process, on its main thread (torchrun gets a parent-death signal, which
Linux ties to the thread that forked it).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cfrun.contract import coordination as co
from cfrun.contract import faults
from cfrun.contract.checkpoints import committed_steps
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import BadInputError, FatalJobError
from cfrun.contract.gpus import FaultWatch
from cfrun.contract.jobdir import JobDir
from cfrun.supervisor.console import ConsoleTap
from cfrun.supervisor.launcher import build_launch_argv, build_worker_env
from cfrun.supervisor.local_ranks import attempt_pids, start_attempt, uses_local_ranks
from cfrun.supervisor.machine import Outcome
from cfrun.supervisor.progress import ProgressLine
from cfrun.supervisor.records import RankRecords
from cfrun.supervisor.signals import forward_pending
from cfrun.supervisor.standby import Standby
from cfrun.supervisor.torchrun_log import read_rank_exits, read_usage_error

logger = logging.getLogger("cfrun")

HOUSEKEEPING_S = 1.0
METRICS_TEXTFILE_S = 5.0
"""Seconds between rewrites of the job dir's ``metrics.prom`` during an attempt."""
"""How often, while ranks run, the supervisor checks the agent, reaps orphans and looks at the
heartbeats. Signals are forwarded within 0.1 s; at 10 Hz the process-table scan of orphan
reaping alone cost 2.6% of a core (bench/adaptive.py's cfrun_no_ckpt run), time taken from
training on a machine whose cores it uses."""


def _oom_kill_files() -> list[Path]:
    """Files with an ``oom_kill N`` line for this process's memory cgroup, most specific
    first: cgroup v2 ``memory.events`` (its subtree included; the ranks are in it too), v1
    ``memory.oom_control``, each under the path /proc/self/cgroup names and at the mount's root
    (a container's own cgroup), then the whole machine's ``/proc/vmstat``."""
    root = Path("/sys/fs/cgroup")
    files = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":
                files += [root / rel / "memory.events", root / "unified" / rel / "memory.events"]
            elif "memory" in controllers.split(","):
                files += [root / "memory" / rel / "memory.oom_control"]
    except (OSError, ValueError):
        pass
    return [*files, root / "memory.events", root / "memory" / "memory.oom_control",
            Path("/proc/vmstat")]


def oom_kill_count() -> int | None:
    """How many processes the kernel's OOM killer has killed so far, in this process's memory
    cgroup where it can be read, else on the whole machine; None where nothing says. The
    monitor compares it before and after an attempt: a rank that died without an error while
    it grew was most likely OOM-killed (evidence that the script, not an outside kill, failed)."""
    for path in _oom_kill_files():
        try:
            for entry in path.read_text().splitlines():
                name, _, count = entry.partition(" ")
                if name == "oom_kill":
                    return int(count)
        except (OSError, ValueError):
            continue
    return None


def output_closed() -> bool:
    """cfrun's stdout or stderr, which the ranks inherit, is a pipe whose reader is gone
    (``cfrun train.py | head -3`` after head exited): ``poll`` reports ``POLLERR`` on such a
    write end. False for a terminal, a file, or an open pipe."""
    import select

    poller = select.poll()
    for fd in (1, 2):
        try:
            poller.register(fd, 0)  # no events asked: POLLERR/POLLHUP are reported anyway
        except (OSError, ValueError):
            continue
    try:
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except OSError:
        return False


def _slow_finalizer(delay_s: Any) -> None:
    """Fault point ``supervisor.finalizer_delay_s``: a ``__del__`` of ``delay_s`` seconds on
    the calling (main) thread, where Python drops a signal handler's exception. None: no-op."""
    if not delay_s:
        return

    class _Slow:
        def __del__(self) -> None:
            time.sleep(float(delay_s))

    _Slow()  # no reference is kept: its __del__ runs here


class Monitor:
    """Runs the attempts of one supervisor, one at a time, each into an :class:`Outcome`.

    Args:
        cfg: the job's settings.
        jobdir: the job dir (locked by the supervisor).
        spawn_fn: starts torchrun: ``spawn_fn(argv, env, cwd) -> Popen`` (tests pass fakes).
        check_agent: called every ``HOUSEKEEPING_S``; restarts a dead persist agent, raises
            FatalJobError if it cannot (the attempt then ends as ``AGENT_LOST``).
        own_processes: the supervisor's long-lived children (the persist agent, the reaper),
            which outlive attempts: never killed or reaped here.
        second_signal: True once a second SIGTERM/SIGINT arrived (:meth:`shutdown` stops
            waiting for the ranks).
        pending_signals: signal numbers queued by the supervisor's handler, forwarded to the
            ranks by :meth:`run` within 0.1 s.
        progress_s: seconds between progress lines on stderr (0: none).
        standby: the warm spares (:class:`cfrun.supervisor.standby.Standby`): an attempt
            after the first becomes them where they are ready; new ones start once the
            attempt made a step.
        console: keeps the ranks' output in the job dir (:mod:`cfrun.supervisor.console`).
    """

    def __init__(self, cfg: RunConfig, jobdir: JobDir, *,
                 spawn_fn: Callable[..., Any],
                 check_agent: Callable[[], None],
                 own_processes: Callable[[], Iterable[subprocess.Popen[bytes] | None]],
                 second_signal: Callable[[], bool],
                 check_stop: Callable[[], None],
                 pending_signals: list[int],
                 progress_s: float = 0.0, standby: Standby | None = None,
                 console: ConsoleTap | None = None) -> None:
        self.cfg = cfg
        self.jobdir = jobdir
        self.spawn_fn = spawn_fn
        self.check_agent = check_agent
        self.own_processes = own_processes
        self.second_signal = second_signal
        self.check_stop = check_stop
        """Raises the stop signal a finalizer swallowed (:meth:`Supervisor._check_stop`)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.attempt = -1
        """The attempt started last (-1: none yet)."""
        self.records = RankRecords(cfg, jobdir)
        """What the ranks left in the job dir (:mod:`cfrun.supervisor.records`)."""
        self.line = ProgressLine(cfg, jobdir, progress_s)
        self.metrics: Any = None  # cfrun.supervisor.metrics.JobMetrics, set by the supervisor
        self.manifest_keys: tuple[str, ...] = ()
        """The job dir's manifest keys in hex, for the ranks (set by the supervisor)."""
        self.job_dir_id: tuple[int, int] | None = None
        """The job dir's (st_dev, st_ino) when the supervisor locked it, for the ranks."""
        self.gpu_faults = FaultWatch()
        self._metrics_at = 0.0
        self._pending_signals = pending_signals
        self.standby = standby
        self.console = console or ConsoleTap()  # unopened: the ranks inherit cfrun's console

    # ------------------------------------------------------------------ one attempt

    def run(self, attempt: int) -> Outcome:
        """Run attempt ``attempt`` to its end and return how it ended (event ``attempt_start``
        before, ``attempt_end`` after; ``hang`` when the ranks hung).

        Raises:
            SignalReceived: from the supervisor's handler (SIGTERM/SIGINT); the supervisor then
                calls :meth:`shutdown`.
        """
        log_path = self.jobdir.attempt_log_path(attempt)
        argv = build_launch_argv(self.cfg, log_path=str(log_path),
                                 log_dir=str(self.jobdir.private_torchrun_logs()))
        env = build_worker_env(self.cfg, attempt, mtbf_s=self.records.mtbf_s(),
                               manifest_keys=self.manifest_keys, job_dir_id=self.job_dir_id)
        warm = self.standby is not None and self.standby.ready()
        warm_ranks = self.standby.ready_ranks() if self.standby is not None and \
            uses_local_ranks(self.cfg) else []
        self.jobdir.emit_event("attempt_start", attempt=attempt, argv=argv,
                               **({"warm": True} if warm else {}),
                               **({"warm_ranks": warm_ranks} if warm_ranks else {}))
        t0 = time.monotonic()
        started_unix_s = time.time()
        self.line.start(t0)  # the first progress line progress_s from now
        oom_before = oom_kill_count()
        self.gpu_faults.start()
        self.attempt = attempt
        # a signal during spawn_fn can leave torchrun running with self.proc unset: shutdown's
        # kill_ranks finds it among our descendants
        self.console.keep_in(self.jobdir.attempt_output_path(attempt))
        self.proc = start_attempt(self.cfg, argv, env, warm=warm, standby=self.standby,
                                  spawn_fn=self.spawn_fn, stdio=self.console.popen_kwargs(),
                                  warm_ranks=tuple(warm_ranks))
        # the attempt's own processes by local rank (its ranks, or its torchrun): a rank
        # started through a spare shows the spare's command line, not the script's
        self.jobdir.emit_event("attempt_pids", attempt=attempt,
                               pids=list(getattr(self.proc, "pids", (self.proc.pid,))))
        _slow_finalizer(faults.value("supervisor.finalizer_delay_s"))
        rc, hung, agent_error = self._wait(attempt, started_unix_s)
        self.console.drain()  # the ranks' last lines before the supervisor's own
        self.kill_ranks()  # stragglers (workers of a killed rank): none may outlive it
        local_exits = tuple(getattr(self.proc, "rank_exits", ()))  # cfrun's own ranks'
        self.proc = None
        try:  # torchrun made its directories with the umask's modes
            self.jobdir.private_torchrun_logs()
        except (OSError, BadInputError) as e:
            logger.warning("cannot make %s private: %s", self.jobdir.torchrun_logs, e)
        duration_s = time.monotonic() - t0
        self.jobdir.emit_event("attempt_end", attempt=attempt, returncode=rc,
                               duration_s=round(duration_s, 3))
        oom_after = oom_kill_count()
        oom_kills = oom_after - oom_before if oom_before is not None and \
            oom_after is not None else 0
        return self._outcome(attempt, rc, duration_s, started_unix_s, log_path, hung=hung,
                             agent_error=agent_error, oom_kills=max(oom_kills, 0),
                             local_exits=local_exits)

    def _wait(self, attempt: int, started_unix_s: float) -> tuple[int, bool, str | None]:
        """Wait for the attempt's process in 0.1 s steps (signals forwarded, the progress
        line), with the housekeeping every ``HOUSEKEEPING_S``: the agent checked, orphans
        reaped, the warm spare tended, GPU faults and metrics, a hang's ranks killed. Returns
        its exit code, whether it hung, and the agent's fatal error (the ranks then killed)."""
        assert self.proc is not None
        hung = False
        agent_error = None
        checked_at = 0.0
        while True:
            try:
                return self.proc.wait(timeout=0.1), hung, agent_error
            except subprocess.TimeoutExpired:
                self.check_stop()
                forward_pending(self._pending_signals, self.proc, self.cfg.launcher,
                                self.jobdir.emit_event)
                self.line.progress(started_unix_s)
                if time.monotonic() - checked_at < HOUSEKEEPING_S:
                    continue
                checked_at = time.monotonic()
                try:
                    self.check_agent()
                except FatalJobError as e:  # the agent died and did not start again
                    agent_error = str(e)
                    self.kill_ranks()
                    continue
                self.reap_orphans()
                if self.standby is not None:
                    self.standby.tend(lambda: self.records.stepped_since(started_unix_s),
                                      lambda: build_worker_env(self.cfg, attempt + 1),
                                      self.jobdir.emit_event)
                self.gpu_faults.poll()
                if self.metrics is not None and time.monotonic() - self._metrics_at >= \
                        METRICS_TEXTFILE_S:
                    self._metrics_at = time.monotonic()
                    self.metrics.write_textfile()
                if self.records.is_hung(started_unix_s):
                    hung = True
                    logger.warning("cfrun: no optimizer step for %ss (--hang-timeout); killing "
                                   "the ranks", self.cfg.hang_timeout_s)
                    self.jobdir.emit_event("hang", attempt=attempt,
                                           hang_timeout_s=self.cfg.hang_timeout_s)
                    self.kill_ranks()

    def _outcome(self, attempt: int, rc: int, duration_s: float, started_unix_s: float,
                 log_path: Path, *, hung: bool, agent_error: str | None,
                 oom_kills: int, local_exits: tuple[tuple[int, int], ...] = ()) -> Outcome:
        """The attempt's :class:`Outcome` from its exit code and what the ranks left
        (``local_exits``: the failed ranks where cfrun started them, else torchrun's log)."""
        errors = self.records.rank_errors(attempt)
        marks = self.records.ended_marks(attempt)
        stopped = self.records.preempted_marks(attempt)
        raised = {e.rank for e in errors}
        rank_exits = (local_exits if uses_local_ranks(self.cfg)
                      else tuple(read_rank_exits(str(log_path)))) if rc else ()
        return Outcome(
            attempt=attempt, returncode=rc, duration_s=duration_s, hung=hung, errors=errors,
            ended_clean=len(marks) == self.cfg.nproc_per_node
            and all(m.get("clean") is True for m in marks.values()),
            # the script's own sys.exit(N): an end mark, neither clean nor preempted, no error
            ranks_exited_nonzero=sum(1 for r, m in marks.items() if m.get("clean") is not True
                                     and not m.get("preempted") and r not in raised),
            ranks_stopped=len(stopped), stop_step=max(stopped, default=None),
            fatal_message=self.records.fatal_message(), last_step=self.records.last_step(),
            oom_kills=oom_kills, agent_error=agent_error,
            committed_steps=tuple(committed_steps(self.jobdir.checkpoints)),
            rank_exits=rank_exits,
            hardware_faults=tuple(self.gpu_faults.faults()) if rc else (),
            made_a_step=self.records.stepped_since(started_unix_s), output_closed=output_closed(),
            launch_error=read_usage_error(str(log_path)) if rc == 2 and not rank_exits
            and self.cfg.launcher == "torchrun" else None)

    def stopped(self, signame: str) -> Outcome:
        """The outcome of the attempt that cfrun's own ``signame`` (SIGTERM/SIGINT) stopped,
        read after :meth:`shutdown` and after the agent stopped (its final commit counts)."""
        stopped = self.records.preempted_marks(self.attempt)
        marks = self.records.ended_marks(self.attempt)  # the script may have ended before it
        return Outcome(attempt=self.attempt, returncode=None, signal=signame,
                       ended_clean=len(marks) == self.cfg.nproc_per_node
                       and all(m.get("clean") is True for m in marks.values()),
                       ranks_stopped=len(stopped), stop_step=max(stopped, default=None),
                       last_step=self.records.last_step(),
                       committed_steps=tuple(committed_steps(self.jobdir.checkpoints)))

    # ------------------------------------------------------------------ processes

    def shutdown(self, signum: int, deadline_s: float) -> None:
        """Preemption: ask the ranks to stop at one step and checkpoint by ``deadline_s``
        (monotonic seconds).

        Writes ``stop_request.json`` with the deadline (unix seconds); the ranks agree on a stop
        step, take a final checkpoint if rank 0 decided it can be durable in time, and exit 0.
        torchrun is not signalled (its handler would kill the ranks at once). At the deadline,
        or on a second signal, every rank is SIGKILLed (a torchrun whose spawn the signal
        interrupted too).
        """
        deadline_unix_s = time.time() + max(0.0, deadline_s - time.monotonic())
        try:
            co.write(co.stop_request_path(self.jobdir.root),
                     co.StopRequest(deadline_unix_s=deadline_unix_s,
                                    signal=signal.Signals(signum).name))
        except OSError as e:  # a full disk: the ranks cannot hear it; they stop at the deadline
            logger.warning("cfrun: cannot write the stop request (%s); the ranks will be "
                           "stopped at the deadline without a final checkpoint", e)
        proc = self.proc
        if proc is not None:
            while time.monotonic() < deadline_s and not self.second_signal():
                try:
                    proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    self.reap_orphans()
            if self.second_signal():
                logger.warning("cfrun: second signal; killing the ranks and the persist agent "
                               "now")
            elif proc.poll() is None:
                logger.warning("cfrun: the ranks did not stop within --grace %ss; killing them",
                               self.cfg.grace_s)
        self.kill_ranks(timeout_s=1.0)
        self.proc = None

    def descendants(self) -> list[Any]:
        """Our processes except the persist agent's tree (it outlives attempts)."""
        import psutil

        me = psutil.Process()
        keep = {p.pid for p in self.own_processes() if p is not None}
        out = []
        for p in me.children(recursive=True):
            try:
                if p.pid in keep or any(a.pid in keep for a in p.parents()):
                    continue
            except psutil.Error:
                continue
            out.append(p)
        return out

    def kill_ranks(self, timeout_s: float = 10.0) -> None:
        """SIGKILL torchrun and every rank and worker below it, then reap them, waiting at
        most about ``timeout_s`` seconds (a process stuck in the kernel is left to init).

        torchrun starts each rank in a session of its own, so a process-group kill would miss
        them; cfrun is a child subreaper, so ranks orphaned by a dead torchrun are still ours.
        A torchrun not yet in ``self.proc`` (a signal during spawn) is among the descendants.
        """
        import psutil

        procs = self.descendants()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        own = attempt_pids(self.proc)
        # torchrun itself is reaped by its Popen (reaping it here would lose its exit status)
        psutil.wait_procs([p for p in procs if p.pid not in own], timeout=timeout_s)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("cfrun: torchrun (pid %d) did not die after SIGKILL", self.proc.pid)
        self.reap_orphans()

    def reap_orphans(self) -> None:
        """Reap exited processes re-parented to us (PID 1, or as subreaper), not our own."""
        import psutil

        own = attempt_pids(self.proc) | {p.pid for p in self.own_processes() if p is not None}
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for c in children:
            if c.pid in own:
                continue
            try:
                if c.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(c.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                continue
