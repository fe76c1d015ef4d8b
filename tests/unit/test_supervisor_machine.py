"""The supervisor's restart policy in-process: outcome + history + policy -> action
(cfrun.supervisor.machine.decide), table-driven; and the monitor turning what a real attempt left
behind (a process that writes the ranks' files and exits) into an outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from cfrun.contract.config import RunConfig
from cfrun.contract.errors import (
    EXIT_FAILED,
    EXIT_FATAL,
    EXIT_PREEMPTED,
    EXIT_SUCCESS,
    FatalJobError,
    JobFailedError,
)
from cfrun.contract.jobdir import JobDir
from cfrun.supervisor.machine import (
    MAX_BACKOFF_S,
    Action,
    ActionKind,
    History,
    Outcome,
    OutcomeKind,
    Policy,
    RankError,
    SupervisorState,
    backoff_delay_s,
    decide,
    normalise_error_message,
)
from cfrun.supervisor.monitor import Monitor

POLICY = Policy(max_restarts=10, crash_loop_limit=3, backoff_s=0.5, job_dir="/jobs/j")


def _error(step: int = 12, rank: int = 0, t: float = 1.0, type_: str = "ValueError",
           message: str = "bad batch at step 12") -> RankError:
    return RankError(rank=rank, type=type_, message=message, step=step, t_unix_s=t)


def raised(step: int = 12, **kw) -> Outcome:
    """The script raised ValueError at ``step`` (torchrun exits 1)."""
    return Outcome(attempt=0, returncode=1, errors=(_error(step),), last_step=step, **kw)


def sigkilled(step: int = 12, **kw) -> Outcome:
    """Rank 1 of two was SIGKILLed from outside; rank 0 saw its peer go (a transport error)."""
    peer_gone = _error(step, rank=0, type_="DistNetworkError",
                       message="Connection closed by peer [127.0.0.1]:24987")
    return Outcome(attempt=0, returncode=1, errors=(peer_gone,), last_step=step, **kw)


def worker_killed(step: int = 12, **kw) -> Outcome:
    """A DataLoader worker of rank 0 was SIGKILLed from outside: torch raises in the rank."""
    error = _error(step, type_="RuntimeError",
                   message="DataLoader worker (pid 4242) is killed by signal: Killed. ")
    return Outcome(attempt=0, returncode=1, errors=(error,), last_step=step, **kw)


def torchrun_killed(step: int = 12, **kw) -> Outcome:
    return Outcome(attempt=0, returncode=-9, last_step=step, **kw)


def hung(step: int = 12) -> Outcome:
    return Outcome(attempt=0, returncode=-9, hung=True, last_step=step)


def drive(outcomes: list[Outcome], policy: Policy = POLICY) -> list[Action]:
    """The supervisor's loop without processes: each outcome is attempt 0, 1, ...; stops at
    the first stop action."""
    history = History()
    actions: list[Action] = []
    for attempt, outcome in enumerate(outcomes):
        outcome = replace(outcome, attempt=attempt)
        action = decide(outcome, history, policy)
        actions.append(action)
        history = history.then(outcome, action)
        if action.kind is ActionKind.STOP:
            break
    return actions


def _kinds(actions: list[Action]) -> list[str]:
    return [a.state.value for a in actions]


@pytest.mark.parametrize("outcomes, states", [
    # the same exception at the same step 3 times: a crash loop
    ([raised(12)] * 3, ["restarting", "restarting", "fatal"]),
    # different steps: no loop (the script got further each time)
    ([raised(12), raised(13), raised(12), raised(13)], ["restarting"] * 4),
    # a kill from outside neither counts nor breaks the row of the script's failures
    ([raised(12), torchrun_killed(12), raised(12), raised(12)],
     ["restarting", "restarting", "restarting", "fatal"]),
    # SIGKILL from outside at the same step, again and again: faults to survive
    ([torchrun_killed(12)] * 5, ["restarting"] * 5),
    ([sigkilled(12)] * 5, ["restarting"] * 5),
    ([worker_killed(12)] * 5, ["restarting"] * 5),
    ([worker_killed(12, oom_kills=1)] * 3, ["restarting", "restarting", "fatal"]),
    # ... unless the kernel OOM-killed a rank: then the script needs too much memory there
    ([sigkilled(12, oom_kills=1)] * 3, ["restarting", "restarting", "fatal"]),
    # the script's own sys.exit(3), no exception: the script's failure
    ([Outcome(attempt=0, returncode=1, ranks_exited_nonzero=1, last_step=40)] * 3,
     ["restarting", "restarting", "fatal"]),
    # a hang is restarted; the same hang 3 times is a loop
    ([hung(12)], ["restarting"]),
    ([hung(12)] * 3, ["restarting", "restarting", "fatal"]),
])
def test_crash_loop_is_the_same_failure_of_the_script_n_times(outcomes, states) -> None:
    assert _kinds(drive(outcomes)) == states


def test_crash_loop_stop_names_the_error_exit_5_and_the_next_command() -> None:
    *_, last = drive([raised(12, committed_steps=(10,))] * 3)
    assert last.exit_code == EXIT_FATAL == 5
    assert last.state_fields == {"attempt": 2, "cause": "crash loop", "error": (
        "crash loop: the same failure 3 times in a row at step 12: ValueError: bad batch at "
        "step 12")}  # the final state event carries the error (cfrun status shows it)
    assert last.error == ("crash loop: the same failure 3 times in a row at step 12: "
                          "ValueError: bad batch at step 12")
    assert last.hint == "fix the script, then: cfrun resume --accept-changed-command /jobs/j"
    assert isinstance(last.exception(), FatalJobError)
    [(kind, fields)] = last.events
    assert kind == "failure" and fields == {
        "attempt": 2, "cause": "exit code 1", "returncode": 1, "hung": False, "step": 12,
        "error": {"type": "ValueError", "message": "bad batch at step 12", "step": 12,
                  "rank": 0}, "made_a_step": True, "detail": "ValueError: bad batch at step 12"}


def test_a_stop_without_a_checkpoint_asks_for_the_command_again_not_a_resume() -> None:
    """Nothing committed: ``cfrun resume`` would replay the same arguments (an argparse typo's
    crash loop; issue 37, item 7), so the hint says to fix them and run the command again."""
    for outcomes, policy in (([raised(12)] * 3, POLICY),
                             ([raised(12)], Policy(max_restarts=0, job_dir="/jobs/j"))):
        *_, last = drive(outcomes, policy)
        assert last.hint is not None and "cfrun resume" not in last.hint
        assert "fix the script or its arguments, then run the command again" in last.hint


def _bug(step: int = 3, type_: str = "KeyError", **kw) -> Outcome:
    return Outcome(attempt=0, returncode=1, last_step=step, errors=(_error(
        step, type_=type_, message="'y'"),), **kw)


def test_a_bugs_exception_before_any_checkpoint_stops_after_one_attempt() -> None:
    """Issue 37, item 5: a KeyError with nothing committed; a restart starts over from step 0
    and raises it again: one attempt, exit 5."""
    [stop] = drive([_bug()])
    assert stop.exit_code == EXIT_FATAL and stop.state_fields["cause"] == \
        "bug before any checkpoint"
    assert stop.error == ("the script raised KeyError: 'y' at step 3, before any checkpoint: a "
                          "restart would start over from step 0 and raise it again; not "
                          "restarted (--crash-loop 0 restarts it)")
    assert stop.hint is not None and "run the command again" in stop.hint


@pytest.mark.parametrize("outcome, policy", [
    (_bug(committed_steps=(2,)), POLICY),  # a checkpoint to go on from: the usual crash loop
    (_bug(), replace(POLICY, crash_loop_limit=0)),  # --crash-loop 0: restart
    (_bug(type_="ValueError"), POLICY),  # may depend on the data, a file, the network
    (_bug(type_="RuntimeError"), POLICY),  # CUDA, NCCL: not the script's Python
    (_bug(oom_kills=1), POLICY),  # the kernel killed a worker: not the script's bug
], ids=["checkpointed", "crash-loop-off", "value-error", "runtime-error", "oom"])
def test_other_failures_after_a_step_are_restarted(outcome, policy) -> None:
    assert _kinds(drive([outcome], policy)) == ["restarting"]


def test_crash_loop_of_a_hang_names_the_cause() -> None:
    *_, last = drive([hung(7)] * 3)
    assert last.error == ("crash loop: the same failure 3 times in a row at step 7: "
                          "hang (no step for --hang-timeout)")


def test_crash_loop_limit_0_is_off_and_limit_1_stops_at_once() -> None:
    off = Policy(max_restarts=10, crash_loop_limit=0)
    assert _kinds(drive([raised(12)] * 6, off)) == ["restarting"] * 6
    assert _kinds(drive([raised(12)], Policy(crash_loop_limit=1))) == ["fatal"]


def test_volatile_parts_of_a_message_do_not_make_failures_differ() -> None:
    """gloo names a new port, a pid and an address each attempt: still one failure."""
    def at_port(port: int) -> Outcome:
        return Outcome(attempt=0, returncode=1, errors=(_error(
            message=f"store at [127.0.0.1]:{port} pid {port + 1} object at 0x7f{port:x}"),))
    assert _kinds(drive([at_port(24987), at_port(31001), at_port(40404)])) == \
        ["restarting", "restarting", "fatal"]
    assert normalise_error_message("Connection to 10.0.0.7:29500 (pid=4411) at 0xdeadbeef") \
        == "Connection to ADDR:PORT (pid=N) at 0xADDR"
    assert normalise_error_message(None) is None


def test_first_failing_rank_is_reported_not_the_peer_that_lost_it() -> None:
    """Rank 1 raised; rank 0's transport error came earlier in time but only reports rank 1's
    death: the failure is rank 1's ValueError."""
    transport = _error(rank=0, t=1.0, type_="DistBackendError", message="Broken pipe")
    real = _error(rank=1, t=2.0)
    outcome = Outcome(attempt=0, returncode=1, errors=(transport, real))
    assert outcome.kind is OutcomeKind.FAILED
    assert outcome.failure.error is not None and outcome.failure.error.rank == 1
    later = _error(rank=0, t=3.0)  # two real errors: the earliest wins
    assert Outcome(attempt=0, returncode=1, errors=(later, real)).failure.error.rank == 1


@pytest.mark.parametrize("max_restarts", [0, 1, 3])
def test_restarts_stop_at_max_restarts_with_exit_4(max_restarts: int) -> None:
    policy = Policy(max_restarts=max_restarts, crash_loop_limit=0, job_dir="/jobs/j")
    actions = drive([torchrun_killed(s, committed_steps=(1,)) for s in range(10)], policy)
    assert _kinds(actions) == ["restarting"] * max_restarts + ["failed"]
    last = actions[-1]
    assert last.exit_code == EXIT_FAILED == 4
    assert last.state_fields == {"attempt": max_restarts, "cause": "killed by SIGKILL",
                                 "error": f"the script failed (killed by SIGKILL) and "
                                          f"--max-restarts {max_restarts} restarts are used up"}
    assert last.error == (f"the script failed (killed by SIGKILL) and --max-restarts "
                          f"{max_restarts} restarts are used up")
    assert last.hint == ("fix the cause, then continue with: cfrun resume "
                         "--accept-changed-command /jobs/j")
    assert isinstance(last.exception(), JobFailedError)
    assert [a.restart for a in actions[:-1]] == list(range(1, max_restarts + 1))


def test_backoff_doubles_per_restart_up_to_30_s() -> None:
    policy = Policy(max_restarts=8, crash_loop_limit=0, backoff_s=4.0)
    actions = drive([raised(s) for s in range(8)], policy)
    assert [a.backoff_s for a in actions] == [4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0, 30.0]
    assert [a.state_fields["backoff_s"] for a in actions] == [a.backoff_s for a in actions]
    assert [backoff_delay_s(0.5, r) for r in (1, 2, 3, 4, 7, 8)] == \
        [0.5, 1.0, 2.0, 4.0, 30.0, 30.0]
    assert MAX_BACKOFF_S == 30.0 and backoff_delay_s(1.0, 60) == 30.0  # no overflow either


def test_no_backoff_after_an_attempt_that_committed_a_newer_checkpoint() -> None:
    """A failure after progress restarts at once; attempts in a row that commit nothing new
    back off, doubling from the base again, and progress resets the doubling."""
    policy = Policy(max_restarts=8, crash_loop_limit=0, backoff_s=4.0)
    commits = [(10,), (10,), (10,), (20, 10), (20, 10), (30, 20), ()]
    actions = drive([sigkilled(12 + i, committed_steps=c) for i, c in enumerate(commits)],
                    policy)
    assert [a.backoff_s for a in actions] == [0.0, 4.0, 8.0, 0.0, 4.0, 0.0, 4.0]
    assert [a.state_fields["backoff_s"] for a in actions] == [a.backoff_s for a in actions]
    # a crash before anything was committed still waits
    assert drive([raised(0)])[0].backoff_s == POLICY.backoff_s


def test_a_restart_says_which_attempt_and_why() -> None:
    [action] = drive([hung(12)])
    assert action.kind is ActionKind.RESTART and action.attempt == 1
    assert action.state is SupervisorState.RESTARTING
    assert action.state_fields == {"attempt": 1, "cause": "hang (no step for --hang-timeout)",
                                   "restart": 1, "backoff_s": 0.5}
    assert action.reports == (("cfrun: training failed (hang (no step for --hang-timeout)); "
                               "restart 1 of 10 from the start (no checkpoint yet)"),)
    assert action.events[0][1]["hung"] is True
    [action] = drive([raised(12, committed_steps=(10,))])
    assert action.reports == (("cfrun: training failed (exit code 1: ValueError: bad batch at "
                               "step 12); restart 1 of 10 from the newest checkpoint (step 10)"),)


def before_first_step(type_: str = "SyntaxError", message: str = "invalid syntax (t.py, line 2)",
                      **kw) -> Outcome:
    """The script failed while starting (no heartbeat in the attempt), its error recorded by
    cfrun.rank.early (step None)."""
    error = RankError(rank=0, type=type_, message=message, step=None, t_unix_s=1.0)
    return Outcome(attempt=0, returncode=1, errors=(error,), made_a_step=False, **kw)


@pytest.mark.parametrize("first", [
    before_first_step(),
    before_first_step("ModuleNotFoundError", "No module named 'torhc'"),
    before_first_step("NameError", "name 'modle' is not defined"),
    # argparse's usage error (exit 2), recorded as SystemExit with argparse's line
    before_first_step("SystemExit", "t.py: error: the following arguments are required: --lr"),
    # torchrun's own usage error: it exited 2 before starting a rank
    Outcome(attempt=0, returncode=2, made_a_step=False,
            launch_error="run.py: error: ambiguous option: --d could match --dup"),
], ids=["syntax", "import", "name", "argparse", "torchrun-usage"])
def test_a_failure_every_start_meets_again_stops_after_one_attempt(first) -> None:
    """Issue 37, item 5: a script that does not compile, imports what is not there, names
    what it never defined or has its arguments refused fails the same way on a second start:
    one attempt, as torchrun's run of it, plus cfrun's start."""
    assert first.kind is OutcomeKind.FAILED
    [stop] = drive([first])
    detail = first.detail
    assert stop.kind is ActionKind.STOP and stop.exit_code == EXIT_FATAL
    assert stop.error == (f"the script failed before its first step ({detail}); cfrun does not "
                          "restart a failure that happens before any step and fails the same "
                          "way every time (--retry-before-first-step does)")
    assert stop.state_fields["error"] == stop.error  # cfrun status shows it
    assert stop.hint is not None and "run the command again" in stop.hint
    [(kind, fields)] = stop.events
    assert kind == "failure" and fields["made_a_step"] is False and fields["detail"] == detail


@pytest.mark.parametrize("first", [
    before_first_step("FileNotFoundError", "[Errno 2] No such file or directory: '/data/x'"),
    before_first_step("RuntimeError", "CUDA error: out of memory"),
    # a rank's own sys.exit(2) before cfrun's runtime started: no record, torchrun's report
    Outcome(attempt=0, returncode=1, made_a_step=False, rank_exits=((0, 2),)),
], ids=["data-mount", "runtime", "bare-exit"])
def test_a_failure_before_the_first_step_runs_twice_then_stops_with_its_message(first) -> None:
    assert first.kind is OutcomeKind.FAILED
    restart, stop = drive([first, first])
    detail = first.detail
    assert "exit code" not in detail or first.rank_exits  # the script's words where it has any
    assert restart.kind is ActionKind.RESTART and restart.reports == ((
        f"cfrun: the script failed before its first step ({detail}); restart 1 of 10 from the "
        "start (no checkpoint yet); a second failure before the first step stops the job"),)
    assert stop.kind is ActionKind.STOP and stop.exit_code == EXIT_FATAL
    assert stop.error == (f"the script failed before its first step twice in a row ({detail}); "
                          "cfrun does not restart a failure that happens before any step "
                          "(--retry-before-first-step does)")
    assert stop.state_fields["error"] == stop.error  # cfrun status shows it
    assert "None" not in stop.error and "None" not in restart.reports[0]
    [(kind, fields)] = stop.events
    assert kind == "failure" and fields["made_a_step"] is False and fields["detail"] == detail


def test_the_option_retries_a_failure_before_the_first_step_up_to_max_restarts() -> None:
    policy = replace(POLICY, max_restarts=5, retry_before_first_step=True)
    actions = drive([before_first_step("FileNotFoundError", "/data/train.bin")] * 6, policy)
    assert _kinds(actions) == ["restarting"] * 5 + ["failed"]  # no crash loop either
    assert actions[-1].exit_code == EXIT_FAILED
    assert [a.backoff_s for a in actions[:3]] == [0.5, 1.0, 2.0]


def test_only_failures_before_the_first_step_in_a_row_stop_the_job() -> None:
    # a step made in between: each such failure gets its restart; a kill is no failure at all
    killed_early = Outcome(attempt=0, returncode=-9, made_a_step=False)
    assert killed_early.kind is OutcomeKind.KILLED
    mount = before_first_step("FileNotFoundError", "/data/train.bin")
    assert _kinds(drive([mount, raised(12), mount])) == ["restarting"] * 3
    assert _kinds(drive([killed_early, killed_early, mount])) == ["restarting"] * 3


@pytest.mark.parametrize("outcome", [
    # the script's BrokenPipeError at print (its message names a broken pipe, as a transport
    # error's does: without the closed pipe it would count as a kill from outside)
    Outcome(attempt=0, returncode=1, last_step=30, output_closed=True,
            errors=(_error(30, type_="BrokenPipeError", message="[Errno 32] Broken pipe"),)),
    Outcome(attempt=0, returncode=1, last_step=30, output_closed=True, rank_exits=((0, 120),)),
], ids=["BrokenPipeError", "exit-120"])
def test_a_closed_output_pipe_stops_at_once(outcome) -> None:
    [action] = drive([outcome])
    assert action.kind is ActionKind.STOP and action.exit_code == EXIT_FAILED
    assert action.error is not None and "output pipe was closed" in action.error
    assert ("BrokenPipeError: [Errno 32] Broken pipe" in action.error) == bool(outcome.errors)
    assert action.events[0][0] == "failure"


@pytest.mark.parametrize("outcome, fields, reports", [
    (Outcome(attempt=4, returncode=0), {"attempt": 4}, ()),
    # every rank finished the script, then one aborted in teardown: done, not restarted
    (Outcome(attempt=4, returncode=1, ended_clean=True), {"attempt": 4},
     (("cfrun: every rank finished the script, then a rank died during interpreter teardown "
       "(exit code 1); counted as success"),)),
])
def test_success_exits_0(outcome: Outcome, fields, reports) -> None:
    action = decide(outcome, History(), POLICY)
    assert outcome.kind is OutcomeKind.SUCCEEDED
    assert (action.kind, action.state, action.exit_code) == \
        (ActionKind.STOP, SupervisorState.SUCCEEDED, EXIT_SUCCESS)
    assert action.state_fields == fields and action.reports == reports
    assert action.exception() is None
    assert [e for e, _ in action.events] == (["teardown_failure"] if reports else [])


def test_a_hang_or_a_nonzero_exit_after_a_clean_end_is_no_teardown_success() -> None:
    assert Outcome(attempt=0, returncode=-9, hung=True, ended_clean=True).kind is \
        OutcomeKind.HUNG
    assert Outcome(attempt=0, returncode=3, ranks_exited_nonzero=1).kind is OutcomeKind.FAILED


@pytest.mark.parametrize("outcome, event, fields, reports", [
    # SIGTERM to cfrun; the ranks stopped at 14 and the final checkpoint 14 is committed
    (Outcome(attempt=2, returncode=None, signal="SIGTERM", ranks_stopped=2, stop_step=14,
             last_step=14, committed_steps=(14, 10)),
     {"step": 14, "final_checkpoint": 14, "newest_committed": 14, "signal": "SIGTERM",
      "ranks_stopped": 2}, {"signal": "SIGTERM"},
     ("cfrun: preempted at step 14; the final checkpoint (step 14) is committed",
      "cfrun: stopped by SIGTERM; resume with: cfrun resume /jobs/j")),
    # the grace was too short: no stop marks, the heartbeat's step, the newest committed one
    (Outcome(attempt=2, returncode=None, signal="SIGINT", last_step=12, committed_steps=(10,)),
     {"step": 12, "final_checkpoint": None, "newest_committed": 10, "signal": "SIGINT",
      "ranks_stopped": 0}, {"signal": "SIGINT"},
     ("cfrun: no final checkpoint; newest committed is step 10",
      "cfrun: stopped by SIGINT; resume with: cfrun resume /jobs/j")),
    # another node's stop request: the ranks exited 0 with preempted marks
    (Outcome(attempt=3, returncode=0, ranks_stopped=1, stop_step=20, committed_steps=()),
     {"step": 20, "final_checkpoint": None, "newest_committed": None, "signal": None,
      "ranks_stopped": 1}, {"attempt": 3},
     ("cfrun: no final checkpoint and none committed before (the job starts over)",)),
])
def test_preempted_exits_75_and_reports_the_final_checkpoint(outcome, event, fields,
                                                            reports) -> None:
    action = decide(outcome, History(restart_count=3), POLICY)
    assert outcome.kind is OutcomeKind.PREEMPTED
    assert (action.state, action.exit_code) == (SupervisorState.PREEMPTED, EXIT_PREEMPTED)
    assert action.exit_code == 75
    assert action.events == (("preempted", event),)
    assert action.state_fields == fields and action.reports == reports


def test_a_signal_after_every_rank_finished_the_script_is_a_success() -> None:
    """A 2-node torchrun job ends its script, then waits in torchrun's exit barrier; SLURM's
    SIGTERM lands there (seen under load): every rank ended clean and none stopped, so the job
    succeeded (exit 0, nothing to requeue), not "preempted" with the script's end-of-run
    checkpoint reported as a final checkpoint a resume would not take."""
    done = Outcome(attempt=0, returncode=None, signal="SIGTERM", ended_clean=True,
                   last_step=69, committed_steps=(69, 49))
    action = decide(done, History(), POLICY)
    assert done.kind is OutcomeKind.SUCCEEDED and not done.is_teardown_failure
    assert (action.state, action.exit_code) == (SupervisorState.SUCCEEDED, 0)
    assert action.reports == ("cfrun: SIGTERM came after every rank had finished the script; "
                              "the job succeeded",)
    # a rank still training (no clean end), or one that stopped for the signal: preempted
    for outcome in (replace(done, ended_clean=False), replace(done, ranks_stopped=1)):
        assert decide(outcome, History(), POLICY).exit_code == 75


def test_fatal_and_agent_lost_exit_5_without_restart() -> None:
    fatal = Outcome(attempt=1, returncode=1, errors=(_error(),),
                    fatal_message="the world size changed from 2 to 4 ranks")
    action = decide(fatal, History(), POLICY)
    assert (action.state, action.exit_code) == (SupervisorState.FATAL, EXIT_FATAL)
    assert action.state_fields == {"attempt": 1,
                                   "message": "the world size changed from 2 to 4 ranks",
                                   "error": "the world size changed from 2 to 4 ranks"}
    assert action.events == ()  # no failure event: nothing to restart
    assert str(action.exception()) == "the world size changed from 2 to 4 ranks"
    lost = Outcome(attempt=1, returncode=-9, agent_error="the persist agent did not start")
    action = decide(lost, History(), POLICY)
    assert lost.kind is OutcomeKind.AGENT_LOST
    assert (action.state, action.exit_code) == (SupervisorState.FATAL, EXIT_FATAL)
    assert isinstance(action.exception(), FatalJobError)


def test_history_counts_restarts_and_keeps_only_the_scripts_failures() -> None:
    history = History()
    for outcome in (raised(12), torchrun_killed(13), hung(14)):
        outcome = replace(outcome, duration_s=2.5)
        history = history.then(outcome, decide(outcome, history, POLICY))
    assert history.restart_count == 3
    assert [f.step for f in history.script_failures] == [12, 14]
    assert history.wall_s == 7.5


# ---------------------------------------------------------------------- the monitor


def _monitor(tmp_path: Path, nproc: int = 2) -> Monitor:
    cfg = RunConfig(script=str(tmp_path / "train.py"), script_args=[],
                    job_dir=str(tmp_path / "job"), cwd=str(tmp_path), nproc_per_node=nproc)
    jd = JobDir(cfg.job_dir)
    jd.create()
    return Monitor(cfg, jd, spawn_fn=None, check_agent=lambda: None,
                   own_processes=lambda: (), second_signal=lambda: False, check_stop=lambda: None,
                   pending_signals=[])


def _attempt_that(tmp_path: Path, code: str, nproc: int = 2) -> Outcome:
    """Run attempt 0 with a real process in place of torchrun, running ``code`` (``JOB`` names
    the job dir, ``mark`` writes a rank's file) and exiting as it says."""
    fresh = tmp_path / f"attempt-{len(list(tmp_path.iterdir()))}"  # one job dir each
    fresh.mkdir()
    monitor = _monitor(fresh, nproc)
    job = str(fresh / "job")
    src = "import json, os, sys\nJOB = " + repr(job) + "\n" + _MARK + textwrap.dedent(code)

    def spawn_fn(argv, env, cwd, **stdio):
        return subprocess.Popen([sys.executable, "-c", src], cwd=cwd)

    monitor.spawn_fn = spawn_fn
    return monitor.run(0)


_MARK = """
def mark(kind, rank, **fields):
    d = os.path.join(JOB, kind)
    os.makedirs(d, exist_ok=True)
    name = (f"attempt-0-rank-{rank}.json" if kind == "errors"
            else f"node-0-attempt-0-rank-{rank}.json")
    with open(os.path.join(d, name), "w") as f:
        json.dump(fields, f)
"""


def test_monitor_reads_a_peer_error_and_a_silent_death_as_a_kill(tmp_path: Path) -> None:
    outcome = _attempt_that(tmp_path, """
        mark("errors", 0, type="DistNetworkError", step=9, t_unix_s=1.0,
             message="Connection closed by peer [127.0.0.1]:4242")
        mark("ended", 0, clean=False, step=9, preempted=False)
        open(os.path.join(JOB, "heartbeat-rank-00000"), "w").write("9\\n")
        sys.exit(1)
        """)
    assert (outcome.returncode, outcome.kind, outcome.last_step) == (1, OutcomeKind.KILLED, 9)
    assert outcome.failure.error.message == "Connection closed by peer [ADDR]:PORT"
    events = [e["event"] for e in JobDir(tmp_path / "attempt-0" / "job").read_events()]
    assert events == ["attempt_start", "attempt_pids", "attempt_end"]


def test_monitor_reads_an_exception_and_a_sys_exit_as_the_scripts(tmp_path: Path) -> None:
    outcome = _attempt_that(tmp_path, """
        mark("errors", 1, type="ValueError", message="bad batch", step=12, t_unix_s=1.0)
        sys.exit(1)
        """)
    assert outcome.kind is OutcomeKind.FAILED
    assert outcome.failure.error == RankError(rank=1, type="ValueError", message="bad batch",
                                              step=12)
    outcome = _attempt_that(tmp_path, """
        mark("ended", 1, clean=False, step=40, preempted=False)
        sys.exit(3)
        """)
    assert (outcome.kind, outcome.returncode, outcome.ranks_exited_nonzero) == \
        (OutcomeKind.FAILED, 3, 1)


def test_monitor_reads_clean_ends_teardown_preemption_and_fatal(tmp_path: Path) -> None:
    both_clean = """
        mark("ended", 0, clean=True, step=60, preempted=False)
        mark("ended", 1, clean=True, step=60, preempted=False)
        os.abort()  # a rank dying in teardown after the script finished
        """
    assert _attempt_that(tmp_path, both_clean).kind is OutcomeKind.SUCCEEDED
    assert _attempt_that(tmp_path, both_clean, nproc=3).kind is OutcomeKind.KILLED  # 1 missing
    outcome = _attempt_that(tmp_path, """
        mark("preempted", 0, step=20)
        mark("preempted", 1, step=20)
        """)
    assert (outcome.kind, outcome.ranks_stopped, outcome.stop_step) == \
        (OutcomeKind.PREEMPTED, 2, 20)
    outcome = _attempt_that(tmp_path, """
        json.dump({"message": "world size changed"}, open(os.path.join(JOB, "fatal.json"), "w"))
        os._exit(1)
        """)
    assert (outcome.kind, outcome.fatal_message) == (OutcomeKind.FATAL, "world size changed")


def test_monitor_counts_an_agent_that_cannot_restart_as_agent_lost(tmp_path: Path) -> None:
    """The agent check fails during the attempt: the ranks are killed, the attempt ends."""
    monitor = _monitor(tmp_path)

    def check_agent() -> None:
        raise FatalJobError("the persist agent did not start (see its output above)")

    monitor.check_agent = check_agent
    monitor.spawn_fn = lambda argv, env, cwd, **stdio: subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], cwd=cwd)
    outcome = monitor.run(0)
    assert outcome.kind is OutcomeKind.AGENT_LOST and outcome.returncode == -9
    assert decide(outcome, History(), POLICY).exit_code == EXIT_FATAL


def test_oom_kill_count_reads_a_number_or_nothing() -> None:
    from cfrun.supervisor.monitor import oom_kill_count

    count = oom_kill_count()
    assert count is None or (isinstance(count, int) and count >= 0)


def test_monitor_takes_a_silent_death_during_an_oom_kill_as_the_scripts(tmp_path: Path,
                                                                         monkeypatch) -> None:
    """A rank SIGKILLs itself without an error: a kill from outside, unless the OOM-kill
    counter grew during the attempt (the kernel's OOM killer, faked here)."""
    import cfrun.supervisor.monitor as M

    silent_death = "os.kill(os.getpid(), 9)"
    assert _attempt_that(tmp_path, silent_death).kind is OutcomeKind.KILLED
    counts = iter([7, 8])
    monkeypatch.setattr(M, "oom_kill_count", lambda: next(counts))
    outcome = _attempt_that(tmp_path, silent_death)
    assert (outcome.kind, outcome.returncode, outcome.oom_kills) == \
        (OutcomeKind.FAILED, -9, 1)


def test_failure_fields_are_json() -> None:
    json.dumps(raised().failure.fields())


def test_an_oom_kill_is_reported_as_out_of_memory_with_the_step() -> None:
    [restart] = drive([sigkilled(17, oom_kills=1)], POLICY)
    assert restart.kind is ActionKind.RESTART
    assert "out of memory at step 17" in restart.reports[0], restart.reports
    actions = drive([sigkilled(17, oom_kills=1)] * 3, POLICY)
    assert actions[-1].kind is ActionKind.STOP and "out of memory at step 17" in (
        actions[-1].error or ""), actions[-1]


NCCL_MISSING = before_first_step("RuntimeError", "Distributed package doesn't have NCCL built in")
PYTHON_LINE = "cfrun --launcher python --job-dir j train.py --lr 0.1"


@pytest.mark.parametrize("outcome", [
    NCCL_MISSING,
    before_first_step("ValueError", "ProcessGroupNCCL is only supported with GPUs, no GPUs found!"),
    before_first_step("RuntimeError", "init_process_group: backend nccl failed"),
    before_first_step("KeyError", "RANK"),
], ids=["nccl-missing", "no-gpu", "init-process-group", "rank"])
@pytest.mark.parametrize("launcher, who", [("torchrun", "torchrun set RANK"),
                                           ("local", "cfrun, as torchrun does, set RANK")])
def test_a_one_rank_script_that_went_distributed_under_torchrun_stops_at_once(
        outcome, launcher, who) -> None:
    """Deterministic (issue 37, item 1): one attempt, and the --launcher python line, under
    torchrun and under the one-node default (``local``: the same variables)."""
    [stop] = drive([outcome], replace(POLICY, python_command=PYTHON_LINE, launcher=launcher))
    assert stop.kind is ActionKind.STOP and stop.exit_code == EXIT_FATAL
    assert stop.error is not None and f"went distributed because {who}" in stop.error
    assert outcome.detail in stop.error and "--launcher python" in stop.error
    assert stop.hint == f"run it as plain python under cfrun: {PYTHON_LINE}"
    assert stop.events[0][0] == "failure"


@pytest.mark.parametrize("policy, outcome", [
    (replace(POLICY, launcher="python"), NCCL_MISSING),  # python set no RANK: its own error
    (replace(POLICY, world_size=2), NCCL_MISSING),  # several ranks: distributed on purpose
    (POLICY, replace(NCCL_MISSING, made_a_step=True)),  # it trained: not the start
    (POLICY, before_first_step("FileNotFoundError", "/data/train.bin")),
], ids=["launcher-python", "two-ranks", "after-a-step", "other-error"])
def test_other_failures_keep_the_usual_rules(policy, outcome) -> None:
    assert _kinds(drive([outcome], policy))[0] == "restarting"


def test_the_default_line_goes_on_in_the_same_job_dir(tmp_path) -> None:
    from cfrun.supervisor.machine import python_launch_command

    cfg = RunConfig(script="/s/train.py", script_args=["--lr", "0.1"], job_dir="/jobs/my job",
                    cwd=str(tmp_path))
    assert Policy.from_config(cfg).python_command == python_launch_command(cfg) == \
        "cfrun --launcher python --job-dir '/jobs/my job' /s/train.py --lr 0.1"


def test_torchruns_log_dir_is_private_before_and_after_an_attempt(tmp_path: Path) -> None:
    """Issue 32, finding 6: torchrun makes ``logs/torchrun/<run>/attempt_0/<rank>/`` with the
    umask's modes (0755), readable by every user while the job dir is 0700. The supervisor
    makes ``logs/torchrun`` 0700 before torchrun runs and drops group and other bits below it
    after the attempt; a link there is neither followed nor changed."""
    import stat

    monitor = _monitor(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    outside.chmod(0o644)
    code = textwrap.dedent("""
        import os, sys
        top = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--log-dir=")][0]
        os.umask(0o022)
        d = os.path.join(top, "run_x", "attempt_0", "0")
        os.makedirs(d)
        open(os.path.join(d, "error.json"), "w").close()
        os.symlink(sys.argv[1], os.path.join(d, "link"))
    """)
    seen: dict = {}

    def spawn_fn(argv, env, cwd, **stdio):
        top = Path([a for a in argv if a.startswith("--log-dir=")][0].split("=", 1)[1])
        seen["mode"] = stat.S_IMODE(os.lstat(top).st_mode)
        return subprocess.Popen([sys.executable, "-c", code, str(outside), *argv], cwd=cwd)

    monitor.spawn_fn = spawn_fn
    monitor.run(0)
    top = tmp_path / "job" / "logs" / "torchrun"
    assert seen["mode"] == 0o700
    made = [top / "run_x", top / "run_x" / "attempt_0", top / "run_x" / "attempt_0" / "0"]
    assert [stat.S_IMODE(os.lstat(p).st_mode) for p in made] == [0o700] * 3
    assert stat.S_IMODE(os.lstat(made[-1] / "error.json").st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(outside).st_mode) == 0o644
