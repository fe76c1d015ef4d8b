"""The supervisor: owns the job dir, starts torchrun, restarts it after failures, handles signals.

States (``SupervisorState``)::

    STARTING -> RUNNING -> SUCCEEDED                 script exited 0
                       -> RESTARTING -> RUNNING      failed, restarts left (backoff in between)
                       -> FAILED                     failed, no restarts left        (exit 4)
                       -> FATAL                      a rank found the resume would be wrong (5)
                       -> PREEMPTED                  SIGTERM/SIGINT to cfrun          (exit 75)

Signals to cfrun become a ``SignalReceived`` exception on the main thread. The shutdown
(:meth:`Supervisor._shutdown`) does not signal torchrun: it writes ``stop_request.json`` with the
grace deadline, the ranks stop at one step, take a final checkpoint if rank 0 decided it fits,
write ``preempted/`` marks and exit 0 (so torchrun does not SIGTERM a rank still finishing). At
the deadline, or at once on a second signal, every rank and the persist agent are SIGKILLed, so
cfrun exits within ``grace_s`` (plus its own exit) and no process outlives it. One ``preempted``
event says which step the job stopped at and whether the final checkpoint was committed.

SIGUSR1 and SIGUSR2 (as PID 1 also SIGHUP and SIGQUIT) are passed on to the ranks
(:func:`forwarded_signals`). A supervisor killed by SIGKILL leaves nothing running either
(``cfrun.supervisor.launcher``: a parent-death signal for torchrun and the agent, a reaper for the rest).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cfrun import __version__
from cfrun.contract import ipc
from cfrun.contract import settings as E
from cfrun.contract.checkpoints import committed_steps
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import (
    EXIT_PREEMPTED,
    EXIT_SUCCESS,
    FatalJobError,
    JobFailedError,
)
from cfrun.contract.manifest import FORMAT_VERSION
from cfrun.contract.jobdir import JobDir, atomic_write_json
from cfrun.supervisor.launcher import (
    build_torchrun_argv,
    build_worker_env,
    die_with_parent,
    kill_job_processes,
    leftover_agent_pid,
    spawn,
    start_reaper,
)
from cfrun.policy import learned_mtbf_s
from cfrun.rank.snapshot import remove_slots

logger = logging.getLogger("cfrun")


def forwarded_signals() -> tuple[signal.Signals, ...]:
    """Signals cfrun passes on to the ranks: SIGUSR1 and SIGUSR2 always; SIGHUP and SIGQUIT too
    when cfrun is PID 1 (a container's entrypoint), where the kernel would otherwise drop them
    (elsewhere they end cfrun, and with it every process of the job, as for any program)."""
    sigs = [signal.SIGUSR1, signal.SIGUSR2]
    if os.getpid() == 1:
        sigs += [signal.SIGHUP, signal.SIGQUIT]
    return tuple(sigs)


def _become_subreaper() -> None:
    """PR_SET_CHILD_SUBREAPER: orphaned descendants (ranks of a dead torchrun) become ours."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


HOUSEKEEPING_S = 1.0
"""How often, while ranks run, the supervisor checks the agent, reaps orphans and looks at the
heartbeats. Signals are forwarded within 0.1 s; at 10 Hz the process-table scan of orphan
reaping alone cost 2.6% of a core (bench/adaptive.py's cfrun_no_ckpt run), time taken from
training on a machine whose cores it uses."""

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
    hung: bool = False


MAX_BACKOFF_S = 30.0
"""The longest wait before a restart."""


def backoff_delay_s(base_s: float, restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...): ``base_s`` doubled per
    restart, at most ``MAX_BACKOFF_S``."""
    return min(base_s * (2 ** (restart - 1)), MAX_BACKOFF_S)


_VOLATILE = [
    (re.compile(r"\[[0-9A-Fa-f:.]*\]:\d+"), "[ADDR]:PORT"),  # gloo: [127.0.0.1]:24987, [::1]:5
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b"), "ADDR:PORT"),
    (re.compile(r"\b(port|pid)([ =:]\s*)\d+", re.I), r"\1\2N"),
    (re.compile(r"\b0x[0-9A-Fa-f]+\b"), "0xADDR"),
]
_TRANSPORT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def normalise_error_message(message: str | None) -> str | None:
    """``message`` with its volatile parts (socket addresses, ports, pids, hex pointers)
    replaced by placeholders, so one bug has one failure signature across attempts."""
    if message is None:
        return None
    for pattern, repl in _VOLATILE:
        message = pattern.sub(repl, message)
    return message


def _is_transport_error(error: dict[str, Any]) -> bool:
    """A rank's error that only reports another rank's death (a collective lost its peer)."""
    message = str(error.get("message") or "")
    return error.get("type") in ("DistNetworkError", "DistBackendError") or \
        any(t in message for t in _TRANSPORT)


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
        self.reaper: subprocess.Popen[bytes] | None = None
        self._shutting_down = False
        self._second_signal = False
        self._attempt = -1
        self.progress_s = float(os.environ.get("CFRUN_PROGRESS_S", "30")) \
            if sys.stderr.isatty() else 0.0
        self._progress_at = 0.0
        self._progress_step = (0.0, 0)
        self._pending_signals: list[int] = []

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
            JobDirLockedError: another cfrun owns the job dir.
            JobFailedError: restarts ran out (exit 4).
            FatalJobError: a rank reported that resuming would be wrong (exit 5).
        """
        jd = self.jobdir
        jd.check_usable()
        jd.create()
        jd.lock()
        self._kill_leftovers()
        self.reaper = start_reaper(self.cfg.job_dir, self.cfg.node_rank)
        _become_subreaper()
        old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        old_forward = {s: signal.signal(s, self._queue_forward) for s in forwarded_signals()}
        try:
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
                jd.unlock()
                self._stop_reaper()

    def _queue_forward(self, signum: int, frame: Any) -> None:
        """Handler of :func:`forwarded_signals`: forwarded by the attempt's loop (≤ 0.1 s)."""
        self._pending_signals.append(signum)

    def _forward_pending(self) -> None:
        """Send the queued signals to the ranks (torchrun's children; not torchrun, whose own
        handler would end the attempt on SIGHUP or SIGQUIT). Event ``signal_forwarded``."""
        import psutil

        while self._pending_signals:
            signum = self._pending_signals.pop(0)
            ranks = []
            if self.proc is not None:
                try:
                    ranks = psutil.Process(self.proc.pid).children()
                except psutil.Error:
                    ranks = []
            for r in ranks:
                try:
                    r.send_signal(signum)
                except psutil.Error:
                    pass
            name = signal.Signals(signum).name
            logger.info("cfrun: forwarded %s to %d rank(s)", name, len(ranks))
            self.jobdir.emit_event("signal_forwarded", signal=name, ranks=len(ranks))

    def _kill_leftovers(self) -> None:
        """With the lock held: kill what a dead supervisor of this job dir (this node) left.

        A persist agent still answering on the job's socket, and torchrun, ranks and workers
        marked with this job dir (cfrun.supervisor.launcher.job_processes), would go on writing into the
        job dir and keep the new agent from binding its socket. Logged and recorded as a
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
        self._shutdown(sig.signum, deadline_s)
        self._stop_agent(deadline_s)
        self._report_preemption(str(sig))
        self._set(SupervisorState.PREEMPTED, signal=str(sig))
        logger.warning("cfrun: stopped by %s; resume with: cfrun resume %s", sig,
                       self.cfg.job_dir)
        return EXIT_PREEMPTED

    def _run_locked(self) -> int:
        jd = self.jobdir
        cfg_json = {**self.cfg.to_json(), "cfrun_version": __version__,
                    "format_version": FORMAT_VERSION}
        atomic_write_json(jd.config_path, cfg_json)
        for stale in ("fatal.json", "stop_request.json", "stop_step.json", "stop_decision.json"):
            (jd.root / stale).unlink(missing_ok=True)
        attempt = self._first_attempt_number()
        restarts = 0
        signatures: list[dict[str, Any]] = []
        while True:
            steps = committed_steps(jd.checkpoints)
            self._set(SupervisorState.RUNNING, attempt=attempt,
                      resume_step=steps[0] if steps else None)
            result = self._run_attempt(attempt)
            jd.emit_event("attempt_end", attempt=attempt, returncode=result.returncode,
                          duration_s=round(result.duration_s, 3))
            succeeded = result.returncode == 0 and not result.hung
            if succeeded and self._preempted_marks(attempt):  # a stop request (another node's)
                self._report_preemption(None)
                self._set(SupervisorState.PREEMPTED, attempt=attempt)
                return EXIT_PREEMPTED
            if not succeeded and not result.hung and self._ended_clean(attempt):
                logger.warning("cfrun: every rank finished the script, then a rank died during "
                               "interpreter teardown (%s); counted as success",
                               _describe(result.returncode))
                jd.emit_event("teardown_failure", attempt=attempt, returncode=result.returncode)
                succeeded = True
            if succeeded:
                self._set(SupervisorState.SUCCEEDED, attempt=attempt)
                return EXIT_SUCCESS
            fatal = jd.root / "fatal.json"
            if fatal.exists():
                message = json.loads(fatal.read_text()).get("message", "unknown")
                self._set(SupervisorState.FATAL, attempt=attempt, message=message)
                raise FatalJobError(message)
            cause = "hang (no step for --hang-timeout)" if result.hung else \
                _describe(result.returncode)
            signature = self._failure_signature(result)
            jd.emit_event("failure", attempt=attempt, cause=cause, **signature)
            signatures.append(signature)
            n = self.cfg.crash_loop_limit
            if n and len(signatures) >= n and all(x == signatures[-1] for x in signatures[-n:]):
                err = signature["error"]
                detail = f"{err['type']}: {err['message']}" if err else cause
                self._set(SupervisorState.FATAL, attempt=attempt, cause="crash loop")
                raise FatalJobError(
                    f"crash loop: the same failure {n} times in a row at step "
                    f"{signature['step']}: {detail}",
                    hint=f"fix the script, then: cfrun resume {self.cfg.job_dir}")
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
            delay_s = backoff_delay_s(self.backoff_s, restarts)
            self._set(SupervisorState.RESTARTING, attempt=attempt, cause=cause, restart=restarts,
                      backoff_s=delay_s)
            self._backoff_wait(delay_s)

    def _backoff_wait(self, delay_s: float) -> None:
        """Wait ``delay_s`` seconds before a restart, reaping orphans meanwhile (PID 1)."""
        deadline = time.monotonic() + delay_s
        while (left_s := deadline - time.monotonic()) > 0:
            time.sleep(min(left_s, 0.1))
            self._reap_orphans()

    def _run_attempt(self, attempt: int) -> AttemptResult:
        argv = build_torchrun_argv(self.cfg)
        env = build_worker_env(self.cfg, attempt, mtbf_s=self._mtbf_s())
        self.jobdir.emit_event("attempt_start", attempt=attempt, argv=argv)
        t0 = time.monotonic()
        started_unix_s = time.time()
        self._attempt = attempt
        # a signal during spawn_fn can leave torchrun running with self.proc unset: _shutdown's
        # _kill_ranks finds it among our descendants
        self.proc = self.spawn_fn(argv, env, self.cfg.cwd)
        hung = False
        checked_at = 0.0
        while True:
            try:
                rc = self.proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                self._forward_pending()
                self._progress(started_unix_s)
                if time.monotonic() - checked_at < HOUSEKEEPING_S:
                    continue
                checked_at = time.monotonic()
                self._check_agent()
                self._reap_orphans()
                if self._is_hung(started_unix_s):
                    hung = True
                    logger.warning("cfrun: no optimizer step for %ss (--hang-timeout); killing "
                                   "the ranks", self.cfg.hang_timeout_s)
                    self.jobdir.emit_event("hang", attempt=attempt,
                                           hang_timeout_s=self.cfg.hang_timeout_s)
                    self._kill_ranks()
        self._kill_ranks()  # stragglers (workers of a killed rank): none may outlive it
        self.proc = None
        return AttemptResult(attempt, rc, time.monotonic() - t0, hung)

    def _progress(self, started_unix_s: float) -> None:
        """Every ``progress_s``, one whole line on cfrun's stderr (a terminal only): step,
        steps/s, newest checkpoint, overhead against the budget. Each line goes out in one
        ``write``, so it never cuts into a line of the script's own output."""
        now = time.monotonic()
        if not self.progress_s or now - self._progress_at < self.progress_s:
            return
        first = self._progress_at == 0.0
        self._progress_at = now
        step = self._last_step()
        if first or step is None:
            self._progress_step = (now, step or 0)
            return
        t0, s0 = self._progress_step
        rate = (step - s0) / max(now - t0, 1e-9)
        self._progress_step = (now, step)
        steps = committed_steps(self.jobdir.checkpoints)
        line = (f"cfrun: step {step} ({rate:.2f} steps/s), newest checkpoint step "
                f"{steps[0] if steps else 'none'}, {self._overhead_text(started_unix_s)}\n")
        try:
            os.write(sys.stderr.fileno(), line.encode())
        except (OSError, ValueError):
            pass

    def _overhead_text(self, started_unix_s: float) -> str:
        """``overhead S% (budget B%)``: training time this attempt lost in checkpoint stalls
        (``checkpoint`` events' ``stall_s`` over the wall time since the attempt started), and
        the policy's latest measured overhead (``adapt`` events) when there is one."""
        stall_s = 0.0
        measured = None
        for e in self.jobdir.read_events():
            if e.get("t_unix_s", 0) < started_unix_s:
                continue
            if e.get("event") == "checkpoint":
                stall_s += float(e.get("stall_s") or 0.0)
            elif e.get("event") == "adapt" and e.get("measured_overhead") is not None:
                measured = float(e["measured_overhead"])
        wall_s = max(time.time() - started_unix_s, 1e-9)
        text = f"overhead {100 * stall_s / wall_s:.2f}% stalled"
        if measured is not None:
            text += f", {100 * measured:.2f}% measured"
        if self.cfg.interval is not None:
            return text + f" (budget {100 * self.cfg.overhead:.2f}%, not applied: --interval)"
        return text + f" (budget {100 * self.cfg.overhead:.2f}%)"

    def _mtbf_s(self) -> float | None:
        """``--mtbf``, else learned from this job's history (wall time per failure)."""
        if self.cfg.mtbf_s:
            return self.cfg.mtbf_s
        events = self.jobdir.read_events()
        wall_s = sum(float(e.get("duration_s", 0)) for e in events
                     if e.get("event") == "attempt_end")
        failures = sum(1 for e in events if e.get("event") == "failure")
        return learned_mtbf_s(wall_s, failures)

    def _is_hung(self, started_unix_s: float) -> bool:
        """No rank wrote a heartbeat (one per optimizer step) for ``hang_timeout_s``."""
        limit = self.cfg.hang_timeout_s
        if not limit:
            return False
        beats = [p.stat().st_mtime for p in self.jobdir.root.glob("heartbeat-rank-*")]
        beats = [t for t in beats if t >= started_unix_s]
        if not beats:  # before the first step: startup, data loading, resume
            return time.time() - started_unix_s > max(limit, 600.0)
        return time.time() - min(beats) > limit

    def _last_step(self) -> int | None:
        steps = []
        for p in self.jobdir.root.glob("heartbeat-rank-*"):
            try:
                steps.append(int(p.read_text().strip() or -1))
            except (OSError, ValueError):
                continue
        return max(steps) if steps else None

    def _ended_clean(self, attempt: int) -> bool:
        """Every rank of this node wrote a clean end-of-script mark in ``attempt``
        (cfrun.rank.core.Runtime._mark_end)."""
        ended = self.jobdir.root / "ended"
        marks = list(ended.glob(f"node-{self.cfg.node_rank}-attempt-{attempt}-rank-*.json"))
        if len(marks) != self.cfg.nproc_per_node:
            return False
        try:
            return all(json.loads(p.read_text()).get("clean") is True for p in marks)
        except (OSError, ValueError):
            return False

    def _failure_signature(self, result: AttemptResult) -> dict[str, Any]:
        """What a failure looked like: exit, the first failing rank's error, the step it reached.

        Of the ranks' errors (``errors/attempt-A-rank-R.json``) the earliest wins (``t_unix_s``,
        else the file's mtime), and a transport error (a peer's death seen through a collective)
        only when no rank had another error. The message is normalised (addresses, ports, hex
        pointers, pids) so that the same bug gives the same signature in every attempt."""
        error = None
        candidates = []
        for path in (self.jobdir.root / "errors").glob(f"attempt-{result.attempt}-rank-*.json"):
            try:
                e = json.loads(path.read_text())
                t = float(e.get("t_unix_s") or path.stat().st_mtime)
                rank = int(path.stem.rsplit("-", 1)[1])
            except (OSError, ValueError, TypeError):
                continue
            candidates.append((_is_transport_error(e), t, rank, e))
        if candidates:
            _, _, rank, e = min(candidates, key=lambda c: c[:3])
            error = {"type": e.get("type"), "message": normalise_error_message(e.get("message")),
                     "step": e.get("step"), "rank": rank}
        return {"returncode": result.returncode, "hung": result.hung, "error": error,
                "step": error["step"] if error else self._last_step()}

    # ------------------------------------------------------------------ processes

    def _descendants(self) -> list[Any]:
        """Our processes except the persist agent's tree (it outlives attempts)."""
        import psutil

        me = psutil.Process()
        keep = {p.pid for p in (self.agent, self.reaper) if p is not None}
        out = []
        for p in me.children(recursive=True):
            try:
                if p.pid in keep or any(a.pid in keep for a in p.parents()):
                    continue
            except psutil.Error:
                continue
            out.append(p)
        return out

    def _kill_ranks(self, timeout_s: float = 10.0) -> None:
        """SIGKILL torchrun and every rank and worker below it, then reap them, waiting at
        most about ``timeout_s`` seconds (a process stuck in the kernel is left to init).

        torchrun starts each rank in a session of its own, so a process-group kill would miss
        them; cfrun is a child subreaper, so ranks orphaned by a dead torchrun are still ours.
        A torchrun not yet in ``self.proc`` (a signal during spawn) is among the descendants.
        """
        import psutil

        procs = self._descendants()
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        own = self.proc.pid if self.proc is not None else None
        # torchrun itself is reaped by its Popen (reaping it here would lose its exit status)
        psutil.wait_procs([p for p in procs if p.pid != own], timeout=timeout_s)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("cfrun: torchrun (pid %d) did not die after SIGKILL", self.proc.pid)
        self._reap_orphans()

    def _reap_orphans(self) -> None:
        """Reap exited processes re-parented to us (PID 1, or as subreaper), not our own."""
        import psutil

        own = {p.pid for p in (self.proc, self.agent, self.reaper) if p is not None}
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

    # ------------------------------------------------------------------ persist agent

    def _start_agent(self) -> None:
        """Start the node's persist agent (its own process group: it outlives rank restarts;
        it is SIGKILLed when the supervisor dies). Main thread only (PR_SET_PDEATHSIG)."""
        argv = [sys.executable, "-m", "cfrun.agent", "--job-dir", self.cfg.job_dir,
                "--keep", str(self.cfg.keep)]
        if self.cfg.peer:
            argv += ["--peer", self.cfg.peer, "--peer-token-file", str(self.cfg.peer_token_file),
                     "--peer-streams", str(self.cfg.peer_streams)]
            if os.environ.get(E.PEER_JOB):
                argv += ["--peer-job", os.environ[E.PEER_JOB]]
        if self.cfg.persist_to:
            argv += ["--persist-to", self.cfg.persist_to]
        if self.cfg.nnodes > 1:
            argv += ["--nnodes", str(self.cfg.nnodes), "--node-rank", str(self.cfg.node_rank),
                     "--local-world-size", str(self.cfg.nproc_per_node)]
        # dies with the supervisor: a SIGKILLed cfrun leaves no agent holding the socket
        self.agent = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent())
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
        remove_slots(self.jobdir.root)

    def _shutdown(self, signum: int, deadline_s: float) -> None:
        """Preemption: ask the ranks to stop at one step and checkpoint by ``deadline_s``
        (monotonic seconds).

        Writes ``stop_request.json`` with the deadline (unix seconds); the ranks agree on a stop
        step, take a final checkpoint if rank 0 decided it can be durable in time, and exit 0.
        torchrun is not signalled (its handler would kill the ranks at once). At the deadline,
        or on a second signal, every rank is SIGKILLed (a torchrun whose spawn the signal
        interrupted too).
        """
        self._shutting_down = True
        deadline_unix_s = time.time() + max(0.0, deadline_s - time.monotonic())
        atomic_write_json(self.jobdir.root / "stop_request.json",
                          {"deadline_unix_s": deadline_unix_s,
                           "signal": signal.Signals(signum).name})
        proc = self.proc
        if proc is not None:
            while time.monotonic() < deadline_s and not self._second_signal:
                try:
                    proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    self._reap_orphans()
            if self._second_signal:
                logger.warning("cfrun: second signal; killing the ranks and the persist agent "
                               "now")
            elif proc.poll() is None:
                logger.warning("cfrun: the ranks did not stop within --grace %ss; killing them",
                               self.cfg.grace_s)
        self._kill_ranks(timeout_s=1.0)
        self.proc = None

    def _preempted_marks(self, attempt: int) -> list[dict[str, Any]]:
        """This node's ranks' ``preempted`` marks of ``attempt`` (cfrun.rank.core)."""
        marks = []
        for p in (self.jobdir.root / "preempted").glob(
                f"node-{self.cfg.node_rank}-attempt-{attempt}-rank-*.json"):
            try:
                marks.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return marks

    def _report_preemption(self, signame: str | None) -> None:
        """One ``preempted`` event: the stop step, the final checkpoint (None if there is
        none) and the newest committed step; a log line says which."""
        steps = committed_steps(self.jobdir.checkpoints)
        newest = steps[0] if steps else None
        marks = self._preempted_marks(self._attempt)
        stop_step = max((int(m["step"]) for m in marks), default=None)
        if stop_step is None:
            stop_step = self._last_step()
        final = stop_step if stop_step is not None and stop_step in steps else None
        self.jobdir.emit_event("preempted", step=stop_step, final_checkpoint=final,
                               newest_committed=newest, signal=signame,
                               ranks_stopped=len(marks))
        if final is not None:
            logger.warning("cfrun: preempted at step %d; the final checkpoint (step %d) is "
                           "committed", stop_step, final)
        else:
            logger.warning("cfrun: no final checkpoint; newest committed is step %s",
                           newest if newest is not None else "none (the job starts over)")
