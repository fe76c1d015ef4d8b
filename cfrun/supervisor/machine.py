"""The supervisor's restart policy as a pure state machine: outcome + history + policy -> action.

The monitor (:mod:`cfrun.supervisor.monitor`) runs one attempt and says how it ended, as an
:class:`Outcome` built from what the attempt left behind (torchrun's exit status, the ranks'
``errors/``, ``ended/`` and ``preempted/`` marks, ``fatal.json``, the heartbeats, the kernel's
OOM-kill counter). :func:`decide` turns that outcome, the :class:`History` of earlier attempts
and the :class:`Policy` into the next :class:`Action`: restart after a backoff, or stop with an
exit code. The supervisor (:mod:`cfrun.supervisor.core`) carries the action out: it writes the
action's events and report lines, sets the state, waits, raises the error. Nothing here reads a
file, a clock or the environment, so every rule is tested in-process
(``tests/unit/test_supervisor_machine.py``). The split follows torch.distributed.elastic, whose
agent monitors the workers into a ``RunResult`` and decides on it in ``_invoke_run``.

How an attempt ended (:attr:`Outcome.kind`)::

    SUCCEEDED   torchrun exited 0; or every rank finished the script, then one died in teardown
    PREEMPTED   SIGTERM/SIGINT/SIGHUP to cfrun, or the ranks stopped for another node's stop request
    FATAL       a rank wrote fatal.json: resuming would be wrong
    AGENT_LOST  the persist agent died and did not come back
    HUNG        no optimizer step for --hang-timeout; the monitor killed the ranks
    FAILED      the script failed: an exception, a non-zero exit, or an OOM kill
    KILLED      a process was killed from outside (SIGKILL of torchrun or of a rank, no OOM
                evidence, no error of the script): a fault to survive, never a crash loop

What :func:`decide` does with it (exit codes: :mod:`cfrun.contract.errors`)::

    SUCCEEDED              -> stop, exit 0
    PREEMPTED              -> stop, exit 75 (a ``preempted`` event: stop step, final checkpoint)
    FATAL, AGENT_LOST      -> stop, exit 5
    FAILED, HUNG, KILLED   -> a ``failure`` event, then
        the console's pipe closed (``| head`` exited)                -> stop, exit 4
        FAILED before the attempt's first optimizer step, one rank with torchrun's
            variables (launcher local or torchrun), an error naming NCCL, RANK or
            init_process_group (the script went distributed because its launcher set RANK;
            the hint: the --launcher python line)                      -> stop, exit 5
        FAILED before the attempt's first optimizer step with an error every start meets
            again (a SyntaxError, an ImportError, a NameError, an argparse usage error),
            or after an attempt that failed before its first step too (it will fail
            again); not with --retry-before-first-step              -> stop, exit 5
        FAILED after a step with a bug's exception (KeyError, TypeError, ...) and no
            checkpoint committed: a restart starts over and meets it again (not with
            --crash-loop 0)                                          -> stop, exit 5
        the same failure of the script --crash-loop times in a row   -> stop, exit 5
        --max-restarts restarts used up                              -> stop, exit 4
        otherwise                    -> restart at once when the attempt committed a newer
                                        checkpoint, else after backoff_s = backoff x 2^(n-1)
                                        <= 30 s, n: attempts in a row without a new commit
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cfrun.contract.config import resume_command
from cfrun.contract.coordination import is_transport_error
from cfrun.contract.errors import (
    EXIT_FAILED,
    EXIT_FATAL,
    EXIT_PREEMPTED,
    EXIT_SUCCESS,
    CfrunError,
    FatalJobError,
    JobFailedError,
)
from cfrun.contract.retry import MAX_BACKOFF_S, backoff_delay_s
from cfrun.supervisor.torchrun_log import describe_rank_exit

if TYPE_CHECKING:
    from cfrun.contract.config import RunConfig


class SupervisorState(str, enum.Enum):
    """Where the supervisor is (``state`` events). Transitions::

        STARTING -> RUNNING -> SUCCEEDED                 script exited 0
                           -> RESTARTING -> RUNNING      failed, restarts left (backoff in between)
                           -> FAILED                     failed, no restarts left        (exit 4)
                           -> FATAL                      crash loop, or resuming would be wrong (5)
                           -> PREEMPTED                  SIGTERM/SIGINT/SIGHUP to cfrun   (exit 75)
    """

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    FATAL = "fatal"
    PREEMPTED = "preempted"


class OutcomeKind(str, enum.Enum):
    """How one attempt ended; the module docstring says what each leads to."""

    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"
    FATAL = "fatal"
    AGENT_LOST = "agent_lost"
    HUNG = "hung"
    FAILED = "failed"
    KILLED = "killed"


_VOLATILE = [
    (re.compile(r"\[[0-9A-Fa-f:.]*\]:\d+"), "[ADDR]:PORT"),  # gloo: [127.0.0.1]:24987, [::1]:5
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b"), "ADDR:PORT"),
    (re.compile(r"\b(port|pid)([ =:]\s*)\d+", re.IGNORECASE), r"\1\2N"),
    (re.compile(r"\b0x[0-9A-Fa-f]+\b"), "0xADDR"),
]


def normalise_error_message(message: str | None) -> str | None:
    """``message`` with its volatile parts (socket addresses, ports, pids, hex pointers)
    replaced by placeholders, so one bug has one failure signature across attempts."""
    if message is None:
        return None
    for pattern, repl in _VOLATILE:
        message = pattern.sub(repl, message)
    return message


_WORKER_KILLED = re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: Killed\b")
"""torch's error in a rank whose DataLoader worker died by SIGKILL
(``torch.utils.data.dataloader``: "DataLoader worker (pid 123) is killed by signal: Killed.")."""


def is_worker_killed_error(error_type: str | None, message: str | None) -> bool:
    """A rank's error that only reports that one of its DataLoader workers was SIGKILLed (by
    something outside the script, or by the OOM killer: :attr:`Outcome.oom_kills` tells)."""
    return error_type == "RuntimeError" and bool(_WORKER_KILLED.search(message or ""))


def describe_returncode(returncode: int) -> str:
    """``killed by SIGKILL`` for a negative exit status, else ``exit code N``."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


HANG_CAUSE = "hang (no step for --hang-timeout)"


@dataclass(frozen=True)
class RankError:
    """One rank's uncaught exception, from ``errors/attempt-A-rank-R.json`` (written by the
    rank's excepthook, cfrun.rank.runtime.Runtime.on_uncaught)."""

    rank: int
    type: str | None
    message: str | None
    step: int | None
    t_unix_s: float = field(default=0.0, compare=False)
    """When the rank failed (unix seconds; the file's mtime if the record lacks it)."""

    @property
    def is_transport(self) -> bool:
        """Only reports another rank's death (:func:`is_transport_error`)."""
        return is_transport_error(self.type, self.message)

    @property
    def is_worker_killed(self) -> bool:
        """Only reports a DataLoader worker's SIGKILL (:func:`is_worker_killed_error`)."""
        return is_worker_killed_error(self.type, self.message)

    def fields(self) -> dict[str, Any]:
        """The ``error`` of a ``failure`` event."""
        return {"type": self.type, "message": self.message, "step": self.step, "rank": self.rank}


def describe_error(error: RankError) -> str:
    """``Type: message`` of a rank's error; an argparse usage error (recorded as ``SystemExit``
    by :mod:`cfrun.rank.early`) is its message alone, as argparse printed it."""
    if error.type == "SystemExit" and error.message:
        return error.message
    return f"{error.type}: {error.message}" if error.message else str(error.type)


def first_error(errors: tuple[RankError, ...]) -> RankError | None:
    """The error that explains a failure: the earliest (``t_unix_s``, then rank), and a
    transport error (a peer's death seen through a collective) only when no rank had another.
    Its message is normalised (:func:`normalise_error_message`)."""
    if not errors:
        return None
    e = min(errors, key=lambda e: (e.is_transport, e.t_unix_s, e.rank))
    return replace(e, message=normalise_error_message(e.message))


@dataclass(frozen=True)
class Failure:
    """What a failure looked like: two failures are the same when all four fields are
    (crash-loop detection). ``fields()`` is what the ``failure`` event records."""

    returncode: int
    hung: bool
    error: RankError | None
    step: int | None

    def fields(self) -> dict[str, Any]:
        return {"returncode": self.returncode, "hung": self.hung,
                "error": self.error.fields() if self.error else None, "step": self.step}


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended, as its evidence (gathered by the monitor after the attempt).

    ``kind`` and ``failure`` are derived from the evidence, here, without I/O."""

    attempt: int
    """Attempt number (0, 1, ... across every cfrun of this job and node)."""
    returncode: int | None
    """torchrun's exit status (negative: killed by that signal); None when cfrun was stopped
    by a signal before the attempt ended."""
    duration_s: float = 0.0
    hung: bool = False
    """The monitor saw no optimizer step for --hang-timeout and killed the ranks."""
    errors: tuple[RankError, ...] = ()
    """The ranks' uncaught exceptions in this attempt (``errors/``)."""
    ended_clean: bool = False
    """Every rank of this node wrote a clean end-of-script mark (``ended/``)."""
    ranks_exited_nonzero: int = 0
    """Ranks that reached the script's end and left it with a non-zero ``sys.exit`` and no
    exception (an end mark that is neither clean nor preempted, no ``errors/`` record)."""
    ranks_stopped: int = 0
    """Ranks that stopped for a preemption (``preempted/`` marks)."""
    stop_step: int | None = None
    """The highest step in the ``preempted/`` marks."""
    fatal_message: str | None = None
    """``fatal.json``'s message: a rank found that resuming would be wrong."""
    last_step: int | None = None
    """The highest step in the ranks' heartbeats."""
    oom_kills: int = 0
    """Processes the kernel's OOM killer killed during the attempt (cgroup or system count)."""
    agent_error: str | None = None
    """The persist agent died and could not be restarted: why."""
    signal: str | None = None
    """``SIGTERM``/``SIGINT``/``SIGHUP``: cfrun itself was stopped by this signal."""
    committed_steps: tuple[int, ...] = ()
    """Committed checkpoint steps when the outcome was taken, newest first."""
    hardware_faults: tuple[str, ...] = ()
    """GPU hardware faults NVML reported during the attempt (critical XID events, uncorrected
    ECC errors; :class:`cfrun.contract.gpus.FaultWatch`)."""
    rank_exits: tuple[tuple[int, int], ...] = ()
    """``(rank, exitcode)`` of the failed ranks in torchrun's report, first observed failure
    last (:func:`cfrun.supervisor.torchrun_log.rank_exits`); negative: killed by that signal."""

    made_a_step: bool = True
    """A rank made an optimizer step during this attempt (a heartbeat written since it
    started); False: the script failed while starting (before the first step)."""
    output_closed: bool = False
    """The console's output is a pipe whose reader is gone (``cfrun train.py | head``): the
    script's ``BrokenPipeError`` is its own, and a restart would meet the same closed pipe."""
    launch_error: str | None = None
    """torchrun's own usage error (it exited 2 before starting a rank): its ``error:`` line."""

    @property
    def kind(self) -> OutcomeKind:
        """How the attempt ended, from the evidence, first match wins: cfrun's own signal
        (succeeded when every rank had ended the script cleanly before it came), the agent
        lost, exit 0 (with stop marks: preempted), a clean end then a teardown death,
        fatal.json, a hang, the script's failure, else a kill from outside."""
        if self.signal is not None:  # unless every rank had finished the script before it
            return OutcomeKind.SUCCEEDED if self.ended_clean and not self.ranks_stopped \
                else OutcomeKind.PREEMPTED
        if self.agent_error is not None:
            return OutcomeKind.AGENT_LOST
        if self.returncode == 0 and not self.hung:
            return OutcomeKind.PREEMPTED if self.ranks_stopped else OutcomeKind.SUCCEEDED
        if not self.hung and self.ended_clean:
            return OutcomeKind.SUCCEEDED  # a rank died in interpreter teardown
        if self.fatal_message is not None:
            return OutcomeKind.FATAL
        if self.hung:
            return OutcomeKind.HUNG
        return OutcomeKind.FAILED if self.is_script_failure else OutcomeKind.KILLED

    @property
    def is_script_failure(self) -> bool:
        """The script failed by itself (it may fail the same way again): a hang, an exception
        other than a peer's death seen through a collective, a non-zero exit of the script, or
        an OOM kill. Otherwise something killed torchrun, a rank or a rank's DataLoader worker
        from outside (a worker's SIGKILL surfaces as the rank's RuntimeError). (A rank that
        dies by SIGSEGV or SIGABRT in native code leaves no record either: it counts as a
        kill, so only ``--max-restarts`` bounds its restarts.)"""
        if self.hardware_faults:  # the GPU failed, not the script: it need not fail again
            return False
        first = first_error(self.errors)
        return (self.hung or (first is not None and not first.is_transport
                                  and not first.is_worker_killed)
                or self.ranks_exited_nonzero > 0 or self.oom_kills > 0
                or self.launch_error is not None or self.rank_exited_by_itself)

    @property
    def rank_exited_by_itself(self) -> bool:
        """No rank recorded an error, and the first rank torchrun saw fail exited with a
        status of its own (``sys.exit(2)`` before cfrun's runtime started), not by a signal."""
        return not self.errors and self.returncode == 1 and bool(self.rank_exits) \
            and self.rank_exits[-1][1] > 0

    @property
    def detail(self) -> str:
        """The script's own words for the failure: its first error
        (:func:`describe_error`: ``SyntaxError: invalid syntax``, argparse's ``train.py:
        error: ...``), else torchrun's usage error, else :attr:`cause` (a kill from outside:
        a peer's "connection closed" says nothing more)."""
        error = first_error(self.errors)
        if error is not None and self.is_script_failure and not self.oom_kills \
                and not self.hung:
            return describe_error(error)
        return self.launch_error or self.cause

    @property
    def is_teardown_failure(self) -> bool:
        """Every rank finished the script cleanly, then a rank died during teardown."""
        return self.returncode not in (0, None) and not self.hung and self.ended_clean

    @property
    def cause(self) -> str:
        """``hang (...)``, ``out of memory at step N (...)``, ``GPU hardware fault: XID 79 on
        GPU 1 (GPU-...)``, the first failed rank as torchrun
        reported it (``rank 1 killed by SIGKILL``, ``rank 0 exit code 1``), or torchrun's own
        ``exit code N`` or ``killed by SIGNAME`` (failure events, reports)."""
        if self.hung:
            return HANG_CAUSE
        if self.oom_kills > 0:
            step = self.failure.step
            return (f"out of memory at step {step if step is not None else '?'} (the kernel's "
                    f"OOM killer killed {self.oom_kills} process(es) of the job)")
        if self.hardware_faults:
            return f"GPU hardware fault: {'; '.join(self.hardware_faults)}"
        if self.rank_exits and self.returncode == 1:  # torchrun's own "a child failed"
            return describe_rank_exit(*self.rank_exits[-1])
        return describe_returncode(self.returncode if self.returncode is not None else 0)

    @property
    def failure(self) -> Failure:
        """The failure's signature: exit, first failing rank's error, the step it reached."""
        error = first_error(self.errors)
        return Failure(returncode=self.returncode if self.returncode is not None else 0,
                       hung=self.hung, error=error,
                       step=error.step if error else self.last_step)


@dataclass(frozen=True)
class History:
    """What earlier attempts of this supervisor did (timings are the numbers given to it)."""

    outcomes: tuple[Outcome, ...] = ()
    restart_count: int = 0
    """Restarts so far (torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""
    script_failures: tuple[Failure, ...] = ()
    """Signatures of the script's own failures, oldest first (kills from outside left out)."""

    @property
    def wall_s(self) -> float:
        """Seconds the attempts ran, all together."""
        return sum(o.duration_s for o in self.outcomes)

    def then(self, outcome: Outcome, action: Action) -> History:
        """This history after ``outcome`` and the ``action`` decided on it."""
        failures = self.script_failures
        if outcome.kind in (OutcomeKind.FAILED, OutcomeKind.HUNG):
            failures = (*failures, outcome.failure)
        return History(outcomes=(*self.outcomes, outcome),
                       restart_count=self.restart_count + (action.kind is ActionKind.RESTART),
                       script_failures=failures)


@dataclass(frozen=True)
class Policy:
    """The restart policy's settings (``cfrun --max-restarts``, ``--crash-loop``)."""

    max_restarts: int = 5
    crash_loop_limit: int = 3
    """The same failure of the script this many times in a row is a crash loop (0: off)."""
    backoff_s: float = 0.5
    """Wait before the first restart; doubled for each further one."""
    max_backoff_s: float = MAX_BACKOFF_S
    job_dir: str = ""
    """Named in the hints (``cfrun resume JOB_DIR``)."""
    node_rank: int = 0
    """This node's index, named in the hints of a node other than 0 (``--node-rank``)."""
    retry_before_first_step: bool = False
    """``--retry-before-first-step``: restart a failure before the first optimizer step like
    any other (up to ``max_restarts``, no crash loop), for a data mount that comes up late."""
    launcher: str = "torchrun"
    """``--launcher`` (resolved): under ``local`` and ``torchrun`` a one-rank job's rank sees
    ``RANK`` (:func:`went_distributed`)."""
    world_size: int = 1
    """Ranks in the job (``--nproc-per-node`` times ``--nnodes``)."""
    python_command: str | None = None
    """The command line that runs this job with ``--launcher python`` (the hint of a one-rank
    script that went distributed because its launcher set ``RANK``); None: none is known."""

    @classmethod
    def from_config(cls, cfg: RunConfig, backoff_s: float = 0.5,
                    python_command: str | None = None) -> Policy:
        """The policy of ``cfg``; ``python_command``: the ``--launcher python`` line as the user
        would type it (default :func:`python_launch_command` of ``cfg``)."""
        return cls(max_restarts=cfg.max_restarts, crash_loop_limit=cfg.crash_loop_limit,
                   backoff_s=backoff_s, job_dir=cfg.job_dir, node_rank=cfg.node_rank,
                   retry_before_first_step=cfg.retry_before_first_step,
                   launcher=cfg.launcher, world_size=cfg.nproc_per_node * cfg.nnodes,
                   python_command=python_command or python_launch_command(cfg))


def python_launch_command(cfg: RunConfig) -> str:
    """``cfrun --launcher python --job-dir DIR SCRIPT ARGS`` (``-m MODULE`` for a module, with
    ``cd CWD &&`` first): the job of ``cfg`` in its job dir, its script started as ``python
    SCRIPT`` would start it. The launcher is not part of the job's command, so this goes on
    with the same job (README, "Command line")."""
    import shlex

    shown = ["-m", cfg.module] if cfg.module else [cfg.script]
    line = shlex.join(["cfrun", "--launcher", "python", "--job-dir", cfg.job_dir, *shown,
                       *cfg.script_args])
    return f"cd {shlex.quote(cfg.cwd)} && {line}" if cfg.module else line


_WENT_DISTRIBUTED = re.compile(r"NCCL|\bRANK\b|init_process_group")
"""Words of a script's error that say it went distributed: NCCL (``Distributed package doesn't
have NCCL built in``, ``ProcessGroupNCCL is only supported with GPUs``), ``RANK``,
``init_process_group``."""


def went_distributed(outcome: Outcome, policy: Policy) -> bool:
    """The attempt of a one-rank job whose launcher sets torchrun's variables (``local``, the
    one-node default, or ``torchrun``) failed before its first step with an error that names
    NCCL, ``RANK`` or ``init_process_group``: the script set up ``torch.distributed`` because
    ``RANK`` was set (nanoGPT, many scripts: DDP whenever ``RANK`` is set) and it cannot on
    this machine. ``python SCRIPT`` would not have; every restart fails the same way."""
    if policy.launcher == "python" or policy.world_size != 1 or outcome.made_a_step \
            or outcome.kind is not OutcomeKind.FAILED:
        return False
    error = first_error(outcome.errors)
    text = describe_error(error) if error is not None else outcome.detail
    return _WENT_DISTRIBUTED.search(text) is not None


DETERMINISTIC_EARLY_ERRORS = frozenset({
    "SyntaxError", "IndentationError", "TabError", "ImportError", "ModuleNotFoundError",
    "NameError", "SystemExit"})
"""Error types a script that fails before its first step meets again on every start: it
does not compile, imports what is not installed, names what it never defined, or argparse
refused its arguments (recorded as ``SystemExit`` by :mod:`cfrun.rank.early`)."""


def is_deterministic_early(outcome: Outcome) -> bool:
    """The attempt failed before its first step with an error that a second start meets
    again (:data:`DETERMINISTIC_EARLY_ERRORS`): the job stops after this one attempt, as
    torchrun's run of it would, plus cfrun's one start (issue 37, item 5), instead of a
    second attempt and its backoff. Other failures before the first step (an ``OSError`` of
    a data mount, a plain ``sys.exit(1)``) get their second attempt."""
    error = first_error(outcome.errors)
    if error is None:  # torchrun refused its own command line
        return outcome.launch_error is not None
    return error.type in DETERMINISTIC_EARLY_ERRORS


BUG_ERRORS = frozenset({
    "KeyError", "IndexError", "TypeError", "AttributeError", "NameError", "UnboundLocalError",
    "ZeroDivisionError", "AssertionError", "NotImplementedError"})
"""Exceptions of a bug in the script's own Python: a deterministic script raises them at the
same step on every run from the same start."""


def is_bug_before_any_checkpoint(outcome: Outcome, policy: Policy) -> bool:
    """The script raised one of :data:`BUG_ERRORS` after its first step, with no checkpoint
    committed (issue 37, item 5): a restart could only start over from step 0 and raise it
    again at the same step, so the job stops after this attempt, as torchrun's run of it
    would, plus cfrun's one start. Not with ``--crash-loop 0`` (no crash loop detection: it
    restarts) nor for a failure another cause may have made (a kill, a hang, an OOM, a GPU
    fault, a peer's death: :attr:`Outcome.is_script_failure` and the error's type)."""
    if not policy.crash_loop_limit or outcome.kind is not OutcomeKind.FAILED \
            or not outcome.made_a_step or outcome.committed_steps or outcome.oom_kills:
        return False
    error = first_error(outcome.errors)
    return error is not None and not error.is_transport and error.type in BUG_ERRORS


class ActionKind(str, enum.Enum):
    RESTART = "restart"
    STOP = "stop"


@dataclass(frozen=True)
class Action:
    """What the supervisor does next. It writes ``events`` (in order), logs ``reports`` as
    warnings, sets ``state`` with ``state_fields``; then, for a restart, waits ``backoff_s``
    and runs attempt ``attempt``; for a stop, raises :meth:`exception` if there is one, else
    exits with ``exit_code``."""

    kind: ActionKind
    state: SupervisorState
    state_fields: Mapping[str, Any]
    exit_code: int = EXIT_SUCCESS
    """The process's exit code for a stop (contract/errors.py); unused for a restart."""
    events: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    reports: tuple[str, ...] = ()
    """Lines for cfrun's log (warnings), each whole."""
    error: str | None = None
    """The one-line error of a failed or fatal stop (the CLI prints ``cfrun: error: ...``)."""
    hint: str | None = None
    backoff_s: float = 0.0
    attempt: int = 0
    """The attempt a restart runs."""
    restart: int = 0
    """Which restart this is (1, 2, ...)."""

    def exception(self) -> CfrunError | None:
        """The error the supervisor raises for this stop: JobFailedError (exit 4),
        FatalJobError (exit 5), or None."""
        if self.error is None:
            return None
        if self.exit_code == EXIT_FAILED:
            return JobFailedError(self.error, hint=self.hint)
        return FatalJobError(self.error, hint=self.hint)


def _stop(state: SupervisorState, exit_code: int, fields: Mapping[str, Any], **kw: Any) -> Action:
    """A stop; its error message goes into the final ``state`` event too (``cfrun status``)."""
    fields = dict(fields)
    if kw.get("error"):
        fields.setdefault("error", kw["error"])
    return Action(ActionKind.STOP, state, fields, exit_code=exit_code, **kw)


def _preempted(outcome: Outcome, policy: Policy) -> Action:
    steps = outcome.committed_steps
    newest = steps[0] if steps else None
    stop_step = outcome.stop_step if outcome.stop_step is not None else outcome.last_step
    final = stop_step if stop_step is not None and stop_step in steps else None
    event = {"step": stop_step, "final_checkpoint": final, "newest_committed": newest,
             "signal": outcome.signal, "ranks_stopped": outcome.ranks_stopped}
    if final is not None:
        reports = [(f"cfrun: preempted at step {stop_step}; the final checkpoint "
                    f"(step {final}) is committed")]
    else:
        reports = [f"cfrun: no final checkpoint; newest committed is step {newest}"
                   if newest is not None else
                   "cfrun: no final checkpoint and none committed before (the job starts over)"]
    if outcome.signal is not None:
        fields: dict[str, Any] = {"signal": outcome.signal}
        reports.append(f"cfrun: stopped by {outcome.signal}; resume with: "
                       f"{resume_command(policy.job_dir, policy.node_rank)}")
    else:  # the ranks stopped for another node's stop request
        fields = {"attempt": outcome.attempt}
    return _stop(SupervisorState.PREEMPTED, EXIT_PREEMPTED, fields,
                 events=(("preempted", event),), reports=tuple(reports))


def _resume_changed(policy: Policy) -> str:
    """The resume line of a hint that asks for a fix first: the fix may edit the script, and
    a plain ``cfrun resume`` refuses an edited script of a job with checkpoints."""
    return resume_command(policy.job_dir, policy.node_rank, "--accept-changed-command")


def restart_delay_s(outcome: Outcome, history: History, policy: Policy) -> float:
    """Seconds to wait before restarting after ``outcome``: none when that attempt committed a
    newer checkpoint than the attempt before it (the first failure since training made
    progress: a restart at once costs nothing, bench/recovery.py measured the 0.5 s wait as 6%
    of a resume), else ``policy.backoff_s`` doubled for each further attempt in a row without
    progress (:func:`backoff_delay_s`, at most ``policy.max_backoff_s``). Pure."""
    outcomes = (*history.outcomes, outcome)
    without_progress = 0
    for i in range(len(outcomes) - 1, -1, -1):
        newest = outcomes[i].committed_steps[:1]
        before = outcomes[i - 1].committed_steps[:1] if i else ()
        if newest and (not before or newest[0] > before[0]):
            break
        without_progress += 1
    if without_progress == 0:
        return 0.0
    return backoff_delay_s(policy.backoff_s, without_progress, policy.max_backoff_s)


def decide(outcome: Outcome, history: History, policy: Policy) -> Action:
    """The supervisor's next action after ``outcome``, given the earlier attempts (``history``,
    not yet including ``outcome``) and ``policy``. Pure: the same input, the same action.

    A crash loop is the same :class:`Failure` of the script ``policy.crash_loop_limit`` times
    in a row; a kill from outside (:attr:`OutcomeKind.KILLED`) neither counts nor breaks the
    row. Restarts, kills included, are limited by ``policy.max_restarts``."""
    kind = outcome.kind
    attempt = outcome.attempt
    if kind is OutcomeKind.PREEMPTED:
        return _preempted(outcome, policy)
    if kind is OutcomeKind.SUCCEEDED:
        if outcome.signal is not None:  # it met the launcher's teardown (a node's exit barrier)
            return _stop(SupervisorState.SUCCEEDED, EXIT_SUCCESS,
                         {"attempt": attempt, "signal": outcome.signal},
                         reports=((f"cfrun: {outcome.signal} came after every rank had finished "
                                   "the script; the job succeeded"),))
        if not outcome.is_teardown_failure:
            return _stop(SupervisorState.SUCCEEDED, EXIT_SUCCESS, {"attempt": attempt})
        return _stop(SupervisorState.SUCCEEDED, EXIT_SUCCESS, {"attempt": attempt},
                     events=(("teardown_failure", {"attempt": attempt,
                                                   "returncode": outcome.returncode}),),
                     reports=(("cfrun: every rank finished the script, then a rank died during "
                               "interpreter teardown "
                               f"({describe_returncode(outcome.returncode or 0)}); counted as "
                               "success"),))
    if kind is OutcomeKind.FATAL:
        message = outcome.fatal_message or "unknown"
        return _stop(SupervisorState.FATAL, EXIT_FATAL, {"attempt": attempt, "message": message},
                     error=message)
    if kind is OutcomeKind.AGENT_LOST:
        return _stop(SupervisorState.FATAL, EXIT_FATAL, {"attempt": attempt,
                                                         "cause": "agent lost"},
                     error=outcome.agent_error)
    # FAILED, HUNG, KILLED
    cause = outcome.cause
    failure = outcome.failure
    events: tuple[tuple[str, Mapping[str, Any]], ...] = (
        ("failure", {"attempt": attempt, "cause": cause, **failure.fields(),
                     "made_a_step": outcome.made_a_step, "detail": outcome.detail}),)
    early = kind is OutcomeKind.FAILED and not outcome.made_a_step
    stop = _stop_on_failure(outcome, history, policy, early)
    if stop is not None:
        return replace(stop, events=events)
    restart = history.restart_count + 1
    delay_s = restart_delay_s(outcome, history, policy)
    steps = outcome.committed_steps
    where = f"from the newest checkpoint (step {steps[0]})" if steps else \
        "from the start (no checkpoint yet)"
    what = f"training failed ({cause})" if outcome.detail == cause else \
        f"training failed ({cause}: {outcome.detail})"
    if early:
        what = f"the script failed before its first step ({outcome.detail})"
        if not policy.retry_before_first_step:
            where += "; a second failure before the first step stops the job"
    return Action(ActionKind.RESTART, SupervisorState.RESTARTING,
                  {"attempt": attempt + 1, "cause": cause, "restart": restart,
                   "backoff_s": delay_s},
                  events=events,
                  reports=(f"cfrun: {what}; restart {restart} of {policy.max_restarts} "
                           f"{where}",),
                  backoff_s=delay_s, attempt=attempt + 1, restart=restart)


def _stop_on_failure(outcome: Outcome, history: History, policy: Policy,
                     early: bool) -> Action | None:
    """The stop a failure leads to (its events not yet set), or None to restart: the closed
    console pipe, a second failure before the first step in a row, a crash loop, restarts used
    up (:func:`decide`)."""
    attempt, cause, failure = outcome.attempt, outcome.cause, outcome.failure
    hint = f"fix the script, then: {_resume_changed(policy)}"
    if not outcome.committed_steps:  # nothing to go on from: a resume would replay the same
        # arguments, and a usage error is in them (issue 37, item 7)
        hint = ("nothing was checkpointed, so there is nothing to resume: fix the script or "
                "its arguments, then run the command again")
    if outcome.output_closed:  # the script's BrokenPipeError reads as a peer's: name it
        error = first_error(outcome.errors)
        said = describe_error(error) if error is not None else outcome.detail
        return _stop(SupervisorState.FAILED, EXIT_FAILED,
                     {"attempt": attempt, "cause": "output closed"},
                     error=f"the script's output pipe was closed (its reader exited, as with "
                           f"| head): {said}; not restarted",
                     hint=f"continue with: {resume_command(policy.job_dir, policy.node_rank)}")
    if early and went_distributed(outcome, policy):
        who = "torchrun" if policy.launcher == "torchrun" else "cfrun, as torchrun does,"
        return _stop(SupervisorState.FATAL, EXIT_FATAL,
                     {"attempt": attempt, "cause": "went distributed under torchrun"},
                     error=f"the script went distributed because {who} set RANK, and it "
                           f"failed before its first step "
                           f"({outcome.detail}); not restarted: it fails the same way every "
                           f"time. --launcher python runs it as python SCRIPT does, without RANK",
                     hint="run it as plain python under cfrun: "
                          f"{policy.python_command or 'cfrun --launcher python SCRIPT [ARGS]'}")
    if early and not policy.retry_before_first_step and is_deterministic_early(outcome):
        return _stop(SupervisorState.FATAL, EXIT_FATAL,
                     {"attempt": attempt, "cause": "failed before the first step"},
                     error=f"the script failed before its first step ({outcome.detail}); "
                           f"cfrun does not restart a failure that happens before any step "
                           f"and fails the same way every time (--retry-before-first-step "
                           f"does)", hint=hint)
    if early and not policy.retry_before_first_step:
        previous = history.outcomes[-1] if history.outcomes else None
        if previous is not None and previous.kind is OutcomeKind.FAILED \
                and not previous.made_a_step:
            return _stop(SupervisorState.FATAL, EXIT_FATAL,
                         {"attempt": attempt, "cause": "failed before the first step"},
                         error=f"the script failed before its first step twice in a row "
                               f"({outcome.detail}); cfrun does not restart a failure that "
                               f"happens before any step (--retry-before-first-step does)",
                         hint=hint)
    if is_bug_before_any_checkpoint(outcome, policy):
        where = f"at step {failure.step}" if failure.step is not None else "after its first step"
        return _stop(SupervisorState.FATAL, EXIT_FATAL,
                     {"attempt": attempt, "cause": "bug before any checkpoint"},
                     error=f"the script raised {outcome.detail} {where}, before any checkpoint: "
                           f"a restart would start over from step 0 and raise it again; not "
                           f"restarted (--crash-loop 0 restarts it)", hint=hint)
    n = policy.crash_loop_limit
    if n and outcome.kind is not OutcomeKind.KILLED and not early:
        row = (*history.script_failures, failure)
        if len(row) >= n and all(x == failure for x in row[-n:]):
            where = f"at step {failure.step}" if failure.step is not None else \
                "before the first step"
            return _stop(SupervisorState.FATAL, EXIT_FATAL,
                         {"attempt": attempt, "cause": "crash loop"},
                         error=f"crash loop: the same failure {n} times in a row {where}: "
                               f"{outcome.detail}", hint=hint)
    if history.restart_count >= policy.max_restarts:
        what = cause if outcome.detail == cause else f"{cause}: {outcome.detail}"
        return _stop(SupervisorState.FAILED, EXIT_FAILED, {"attempt": attempt, "cause": cause},
                     error=f"the script failed ({what}) and --max-restarts "
                           f"{policy.max_restarts} restarts are used up",
                     hint=hint if not outcome.committed_steps else
                     f"fix the cause, then continue with: {_resume_changed(policy)}")
    return None
