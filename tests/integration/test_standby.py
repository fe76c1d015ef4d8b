"""The warm spare of a ``--launcher python`` job, and a torchrun job's warm torchrun (issue
35, "a warm restart";
:mod:`cfrun.supervisor.standby`, :mod:`cfrun.rank.spare`).

Real processes and real SIGKILLs: a rank killed once the spare said it was ready is replaced by
the spare (``attempt_start`` and ``resumed`` say ``warm``), twice in a row, and the run ends
bit-identical to the plain ``python`` run; a killed spare is replaced and the restart still
exact; cfrun SIGKILLed leaves no spare behind; ``CFRUN_STANDBY=0`` keeps none. The spare runs a
script as ``python SCRIPT`` does: the same ``__file__``, ``sys.argv``, ``sys.path[0]``,
``__main__`` attributes and the same traceback for an uncaught error.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import (
    SCRIPTS,
    Run,
    assert_bit_identical,
    assert_resumed_from_newest,
    clean_env,
    final_line,
    job_events,
    plain_run,
    run_cfrun,
    shared_run,
)

from cfrun.contract import faults

pytestmark = pytest.mark.spares  # the subject (tests/conftest.py, _spares)

TINY = str(SCRIPTS / "train_tiny.py")
# 0.1 s a step (cfrun's hook sleeps; the plain run computes the same): ~16 s an epoch, time
# for the spare to import torch on a busy machine before the test kills the rank
SLOW = faults.arm({}, **{"rank.step_delay_s": 0.1})




def _start(tmp_path: Path, args: list[str], env: dict[str, str] | None = None,
           launcher: str = "python", unset: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    full = clean_env({**SLOW, **(env or {})})
    for name in unset:
        full.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--launcher", launcher, "--job-dir", "j", *args],
        cwd=tmp_path, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(cond, proc: subprocess.Popen, timeout_s: float = 180) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, (proc.communicate()[1] or "")[-3000:]
        time.sleep(0.05)
    raise AssertionError("timed out")


def _ready_spare(job: Path, proc: subprocess.Popen[str], seen: int) -> int:
    """The pid of the spare of the ``seen+1``-th ``standby_ready`` event, once it is logged."""
    ready = _wait(lambda: job_events(job, "standby_ready")[seen:], proc)
    return ready[0]["pid"]  # type: ignore[index]


def _attempt_pids(job: Path, proc: subprocess.Popen[str], attempt: int = 0) -> list[int]:
    """The pids of an attempt's ranks by local rank (the ``attempt_pids`` event), once
    logged: a rank started through a spare shows the spare's command line, not the
    script's."""
    def find() -> list[int] | None:
        return next((e["pids"] for e in job_events(job, "attempt_pids")
                     if e["attempt"] == attempt), None)

    return _wait(find, proc)  # type: ignore[return-value]


def _cold_rank(proc: subprocess.Popen[str], job: Path) -> psutil.Process:
    """The first attempt's rank, once started."""
    return psutil.Process(_attempt_pids(job, proc)[0])


def _torchrun_rank(proc: subprocess.Popen[str], after: int | None = None) -> psutil.Process:
    """The rank of a torchrun job (torchrun runs it as ``python -u SCRIPT``), once started; with
    ``after``, a rank other than that pid."""
    def find() -> psutil.Process | None:
        for c in psutil.Process(proc.pid).children(recursive=True):
            try:
                launcher = " ".join(c.parent().cmdline())  # torchrun: not a loader worker
                if c.cmdline()[1:3] == ["-u", TINY] and c.pid != after and (
                        "torchrun_log" in launcher or "cfrun.rank.spare" in launcher):
                    return c
            except psutil.Error:
                continue
        return None

    return _wait(find, proc)  # type: ignore[return-value]


def _kill_when_spare_ready(job: Path, proc: subprocess.Popen[str], rank: psutil.Process,
                           seen: int, commits: int) -> int:
    """Once ``commits`` checkpoints are committed, SIGSTOP the rank (training stops: a busy
    machine may take long to import torch in the spare), wait for the ``seen+1``-th
    ``standby_ready``, then SIGKILL the rank. Returns the spare's pid, the next rank."""
    _wait(lambda: len(job_events(job, "commit")) >= commits, proc)
    rank.send_signal(signal.SIGSTOP)
    spare = _ready_spare(job, proc, seen)
    rank.kill()
    return spare


def _commit_after_the_resume(job: Path, proc: subprocess.Popen[str]) -> None:
    """Wait for the first resume, then for a commit past its step."""
    _wait(lambda: job_events(job, "resumed"), proc)
    resumed_at = job_events(job, "resumed")[0]["step"]
    _wait(lambda: any(e["step"] > resumed_at for e in job_events(job, "commit")), proc)


def _two_warm_kills(tmp_path: Path, args: list[str], env: dict[str, str] | None = None,
                    launcher: str = "python") -> Run:
    """Start the job (:func:`_start`, job dir ``j``), SIGKILL its rank once the first spare is
    ready, wait for a commit after the resume, SIGKILL the next rank once the second spare is
    ready, and wait for the end: its exit code and output."""
    job = tmp_path / "j"
    proc = _start(tmp_path, args, env=env, launcher=launcher)
    try:
        spare = _kill_when_spare_ready(job, proc, _cold_rank(proc, job), 0, 1)
        _commit_after_the_resume(job, proc)
        _kill_when_spare_ready(job, proc, psutil.Process(spare), 1, 1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Run(proc.returncode, out, err, job)


def _ends_as_plain(tmp_path: Path, run: Run, plain: subprocess.CompletedProcess[str]) -> None:
    """Two kills: each resume from the newest commit, and the plain run's weights and line."""
    assert_resumed_from_newest(run, 2)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "got.pt"))
    assert final_line(run.stdout) == final_line(plain.stdout)


def _plain(tmp_path: Path, factory: pytest.TempPathFactory) -> Run:
    """``python TINY --epochs 3``, run once per session (:func:`shared_run`: four tests compare
    with it), its ``plain.pt`` copied into ``tmp_path``."""
    def make(cwd: Path) -> Run:
        p = plain_run([TINY, "--epochs", "3", "--out", "plain.pt"], cwd)
        return Run(p.returncode, p.stdout, p.stderr, cwd)

    plain = shared_run(factory, "tiny3-plain", make)
    shutil.copy(Path(plain.cwd or "") / "plain.pt", tmp_path / "plain.pt")
    return plain


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [pytest.param("python", marks=pytest.mark.extended), "auto"])
def test_two_kills_are_recovered_by_warm_spares_bit_identical(tmp_path, tmp_path_factory, launcher):
    """Each SIGKILL of the rank after a spare said it was ready: the next attempt is the spare
    (no new interpreter: the process existed before the attempt started), resumes from the
    newest committed step, and the run ends with the plain run's weights and final line;
    under ``--launcher python`` and the one-node default (``auto``: ``local``, the rank with
    torchrun's variables)."""
    plain = _plain(tmp_path, tmp_path_factory)
    job = tmp_path / "j"
    run = _two_warm_kills(tmp_path, ["--interval", "10", TINY, "--epochs", "3", "--out",
                                     "got.pt"], launcher=launcher)
    out, err = run.stdout, run.stderr
    assert run.returncode == 0, err[-3000:]
    starts = job_events(job, "attempt_start")
    assert len(starts) == 3 and not starts[0].get("warm"), starts
    assert all(s.get("warm") for s in starts[1:]), starts
    resumed = job_events(job, "resumed")
    assert len(resumed) == 2 and all(r.get("warm") for r in resumed), resumed
    # the spare's "process start" is its go: after the attempt's start, not its fork
    for s, r in zip(starts[1:], resumed):
        assert r["process_start_unix_s"] >= s["t_unix_s"] - 0.01, (s, r)
    # what the rank had imported at its first step, for the spares to import ahead
    recorded = json.loads((job / "warm-imports-node-0.json").read_text())["modules"]
    assert "torch._dynamo" in recorded and "torch" in recorded
    assert not any(m.split(".")[0] in ("__main__", "cfrun", "sitecustomize") for m in recorded)
    _ends_as_plain(tmp_path, Run(0, out, err, job), plain)


@pytest.mark.extended  # a spare as the next attempt: the tests of the local launcher
@pytest.mark.torchrun
def test_a_torchrun_jobs_next_torchrun_is_the_warm_spare_twice_and_exact(tmp_path,
                                                                         tmp_path_factory):
    """Under torchrun (``--launcher torchrun``; several nodes) the spare is the next attempt's
    torchrun, torch's launcher imported: each SIGKILL of the rank once it is ready restarts
    from it (the new rank is the spare's child: torchrun ran in the process that existed
    before the attempt),
    from the newest committed step, and the run ends with the plain run's weights and line."""
    plain = _plain(tmp_path, tmp_path_factory)
    job = tmp_path / "j"
    proc = _start(tmp_path, ["--interval", "10", TINY, "--epochs", "3", "--out", "got.pt"],
                  launcher="torchrun")
    try:
        first = _torchrun_rank(proc)
        spare = _kill_when_spare_ready(job, proc, first, 0, 1)
        second = _torchrun_rank(proc, after=first.pid)
        assert second.parent().pid == spare
        _commit_after_the_resume(job, proc)
        spare = _kill_when_spare_ready(job, proc, second, 1, 1)
        assert _torchrun_rank(proc, after=second.pid).parent().pid == spare
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    starts = job_events(job, "attempt_start")
    assert [bool(s.get("warm")) for s in starts] == [False, True, True], starts
    _ends_as_plain(tmp_path, Run(0, out, err, job), plain)


@pytest.mark.slow
def test_a_kill_during_the_hand_over_restarts_cold_and_exact(tmp_path, tmp_path_factory):
    """The spare SIGKILLed after it took the go, before it became the rank (held there by the
    fault point ``rank.spare_go_delay_s``): that attempt fails without a step; the next starts
    from the spare the killed one forked at its go, before the hold (a copy made before
    anything of the job ran), resumes from the newest committed step, and the run ends with
    the plain run's weights and line."""
    plain = _plain(tmp_path, tmp_path_factory)
    job = tmp_path / "j"
    proc = _start(tmp_path, ["--interval", "10", TINY, "--epochs", "3", "--out", "got.pt"],
                  env=faults.arm(SLOW, **{"rank.spare_go_delay_s": 120}))
    try:
        spare = _kill_when_spare_ready(job, proc, _cold_rank(proc, job), 0, 1)
        out1 = job / "logs" / "attempt-1-output.log"  # the spare says it took the go
        _wait(lambda: out1.exists() and "took the go" in out1.read_text(), proc)
        os.kill(spare, signal.SIGKILL)  # in the hand-over: it holds the go for 120 s
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    starts = job_events(job, "attempt_start")
    assert [bool(s.get("warm")) for s in starts] == [False, True, True], (
        [(e["event"], e.get("pid"), e.get("attempt")) for e in job_events(job)], err[-2000:])
    resumed = job_events(job, "resumed")
    assert [r["attempt"] for r in resumed] == [2], resumed
    newest = max(e["step"] for e in job_events(job, "commit")
                 if e["t_unix_s"] < starts[2]["t_unix_s"])
    assert resumed[0]["step"] == newest, (resumed, newest)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "got.pt"))
    assert final_line(out) == final_line(plain.stdout)


@pytest.mark.slow
def test_a_killed_spare_is_replaced_and_the_restart_is_exact(tmp_path, tmp_path_factory):
    """SIGKILL the ready spare: the supervisor starts another (a second ``standby_ready`` in the
    same attempt); a kill of the rank then restarts warm, from the second spare, and the run
    ends bit-identical."""
    _plain(tmp_path, tmp_path_factory)
    job = tmp_path / "j"
    proc = _start(tmp_path, ["--interval", "10", TINY, "--epochs", "3", "--out", "got.pt"])
    try:
        rank = _cold_rank(proc, job)
        _wait(lambda: job_events(job, "commit"), proc)
        rank.send_signal(signal.SIGSTOP)  # no step until the test is done with the spares
        first = _ready_spare(job, proc, 0)
        os.kill(first, signal.SIGKILL)
        assert _ready_spare(job, proc, 1) != first
        rank.kill()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    starts = job_events(job, "attempt_start")
    assert [bool(s.get("warm")) for s in starts] == [False, True], starts
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "got.pt"))


@pytest.mark.slow
def test_where_torch_starts_threads_the_spare_does_not_fork_and_the_restart_is_exact(tmp_path):
    """Without ``OMP_NUM_THREADS`` (one rank on a user's machine) ``import torch`` starts
    OpenMP's threads, and a fork would keep only one: the first rank starts cold, a spare
    started once it made a step (no ``forked``) takes the restart, it does not fork the next
    (a thread of its own), and the run ends bit-identical with the plain run (run with the same
    environment)."""
    plain = subprocess.run([sys.executable, TINY, "--epochs", "3", "--out", "plain.pt"],
                           cwd=tmp_path, env={k: v for k, v in clean_env().items()
                                              if k != "OMP_NUM_THREADS"},
                           capture_output=True, text=True, timeout=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    job = tmp_path / "j"
    proc = _start(tmp_path, ["--interval", "10", TINY, "--epochs", "3", "--out", "got.pt"],
                  unset=("OMP_NUM_THREADS",))
    try:
        rank = _cold_rank(proc, job)
        assert rank.cmdline()[1:2] == [TINY]  # started as python SCRIPT, not as a spare
        spare = _kill_when_spare_ready(job, proc, rank, 0, 1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    ready = job_events(job, "standby_ready")
    assert ready and not any(e.get("forked") for e in ready), ready
    assert [e["pids"] for e in job_events(job, "attempt_pids")][1] == [spare]
    assert [bool(s.get("warm")) for s in job_events(job, "attempt_start")] == [False, True]
    assert_resumed_from_newest(Run(0, out, err, job), 1)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "got.pt"))
    assert final_line(out) == final_line(plain.stdout)


def test_cfrun_killed_leaves_no_spare_and_standby_0_keeps_none(tmp_path):
    """SIGKILL of cfrun itself: the spare dies with it (parent-death signal; the reaper). With
    ``CFRUN_STANDBY=0`` no spare starts and a restart is cold."""
    job = tmp_path / "j"
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        # files, not pipes: the test waits for cfrun, not for every holder of its output
        proc = subprocess.Popen(
            [sys.executable, "-m", "cfrun", "--launcher", "python", "--job-dir", "j",
             "--interval", "10", TINY, "--epochs", "2", "--out", "got.pt"],
            cwd=tmp_path, env=clean_env(SLOW), stdout=out, stderr=err)
    rank = _cold_rank(proc, job)
    _wait(lambda: job_events(job, "commit"), proc)
    rank.send_signal(signal.SIGSTOP)
    spare = _ready_spare(job, proc, 0)
    proc.kill()
    proc.wait(timeout=300)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and psutil.pid_exists(spare) and \
            psutil.Process(spare).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    assert not psutil.pid_exists(spare) or psutil.Process(spare).status() == \
        psutil.STATUS_ZOMBIE, "the spare outlived cfrun"

    cold = tmp_path / "cold"
    cold.mkdir()
    p = subprocess.run([sys.executable, "-m", "cfrun", "--launcher", "python", "--job-dir", "j",
                        "--interval", "10", "--inject-crash", "15", TINY, "--epochs", "1",
                        "--out", "got.pt"], cwd=cold,
                       env=clean_env({**faults.arm({}, **{"rank.step_delay_s": 0.02}),
                                      "CFRUN_STANDBY": "0"}),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not job_events(cold / "j", "standby_ready")
    assert [bool(s.get("warm")) for s in job_events(cold / "j", "attempt_start")] == [False, False]


# ------------------------------------------------------------- the spare runs a script as python

PROBE = '''import os, sys
print("file", __file__)
print("argv", sys.argv)
print("path0", sys.path[0])
print("main", __name__, __spec__, __package__, type(__loader__).__name__, __cached__)
print("module", sys.modules["__main__"].__dict__ is globals())

def f():
    raise ValueError("boom " + sys.argv[1])

f()
'''


def _spare_run(cwd: Path, script: str, args: list[str], extra_env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    """A spare made by hand (``cfrun.rank.spare FD``), sent the go of ``python SCRIPT ARGS``."""
    from cfrun.supervisor.launcher import module_argv

    ours, theirs = socket.socketpair()
    env = clean_env(extra_env or {})
    p = subprocess.Popen(module_argv("cfrun.rank.spare", str(theirs.fileno())), cwd=cwd,
                         env=env, pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    theirs.close()
    assert ours.recv(6) == b"ready\n"
    ours.sendall(json.dumps({"env": env, "script": script, "module": None,
                             "args": args}).encode())
    ours.shutdown(socket.SHUT_WR)
    out, err = p.communicate(timeout=300)
    ours.close()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_the_spare_runs_a_script_as_python_does(tmp_path):
    """``__file__``, ``sys.argv``, ``sys.path[0]``, the ``__main__`` module's attributes, the
    uncaught error's traceback (no frame of cfrun's) and the exit code equal ``python
    SCRIPT``'s, for a relative script path run from another directory."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    plain = subprocess.run([sys.executable, "sub/probe.py", "x"], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=300)
    spare = _spare_run(tmp_path, "sub/probe.py", ["x"])
    assert plain.returncode == 1 and spare.returncode == 1
    assert spare.stdout == plain.stdout
    assert spare.stderr == plain.stderr, spare.stderr
    assert "cfrun" not in spare.stderr


IMPORTED = '''import sys
for name in sys.argv[1:]:
    print(name, name in sys.modules)
'''
RECORDED = ["json", "torch._dynamo", "wave", "this", "cfrun.cli.app", "sklearn",
            "no_such_module_zz", "os; import x", "__main__"]


@pytest.mark.parametrize("ahead", ["1", "0"])
def test_the_spare_imports_ahead_what_the_last_rank_imported(tmp_path, ahead):
    """Before it says ready, a spare imports the modules of the node's ``warm-imports`` record
    whose package is torch's stack or the standard library (``torch._dynamo``, which the first
    optimizer imports, ~1 s): the script finds them imported. Never a module outside them
    (sklearn), cfrun's, the script's, an acting stdlib module (``this`` prints), a malformed
    name; a missing one is skipped. ``CFRUN_STANDBY_IMPORTS=0``: none."""
    from cfrun.contract import coordination as co

    (tmp_path / "j").mkdir(mode=0o700)
    co.warm_imports_path(tmp_path / "j", 0).write_text(json.dumps({"modules": RECORDED}))
    (tmp_path / "probe.py").write_text(IMPORTED)
    names = ["torch._dynamo", "wave", "this", "cfrun.cli.app", "sklearn"]
    got = _spare_run(tmp_path, "probe.py", names, {
        "CFRUN_RANK_JOB_DIR": str(tmp_path / "j"), "CFRUN_STANDBY_IMPORTS": ahead})
    assert got.returncode == 0, got.stderr[-3000:]
    on = ahead == "1"
    assert got.stdout.splitlines() == [f"torch._dynamo {on}", f"wave {on}", "this False",
                                       "cfrun.cli.app False", "sklearn False"]
    assert "Zen of Python" not in got.stdout + got.stderr


def test_a_spare_stopped_before_its_go_exits_quietly(tmp_path):
    """The supervisor closing the socket (the job ended, the spare no longer wanted) ends the
    spare with status 0 and nothing on its output."""
    from cfrun.supervisor.launcher import module_argv

    ours, theirs = socket.socketpair()
    p = subprocess.Popen(module_argv("cfrun.rank.spare", str(theirs.fileno())), cwd=tmp_path,
                         env=clean_env(), pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    theirs.close()
    assert ours.recv(6) == b"ready\n"
    ours.close()
    out, err = p.communicate(timeout=300)
    assert (p.returncode, out, err) == (0, "", "")


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_a_bad_standby_setting_is_one_line_and_exit_2(tmp_path, value):
    p = subprocess.run([sys.executable, "-m", "cfrun", "--launcher", "python", "--job-dir", "j",
                        TINY, "--epochs", "1", "--out", "got.pt"], cwd=tmp_path,
                       env=clean_env({"CFRUN_STANDBY": value}), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "CFRUN_STANDBY" in p.stderr and value in p.stderr
    assert not (tmp_path / "j" / "checkpoints").exists() or not any(
        (tmp_path / "j" / "checkpoints").iterdir())


# ------------------------------------------- several ranks: cfrun starts them, a spare per rank

DDP = str(SCRIPTS / "train_ddp.py")


def _plain_torchrun(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 train_ddp.py plain.pt``, no cfrun; run again
    (at most twice) where torch 2.13's gloo aborted a rank in its teardown (``terminate called
    without an active exception``, conftest.plain_run): torchrun then SIGTERMs rank 0, which
    may be writing ``plain.pt`` (seen once in a CI-like run)."""
    for _ in range(3):
        plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", "2", DDP, "plain.pt"], cwd=tmp_path,
                               env=clean_env(), capture_output=True, text=True, timeout=300)
        if plain.returncode == 0 or \
                "terminate called without an active exception" not in plain.stderr:
            break
    assert plain.returncode == 0, plain.stderr[-3000:]
    return plain


def _start_ddp(tmp_path: Path) -> subprocess.Popen[str]:
    return _start(tmp_path, ["--nproc-per-node", "2", "--interval", "10", DDP, "got.pt"])


def _cold_ranks(proc: subprocess.Popen[str], job: Path) -> dict[int, psutil.Process]:
    """The first attempt's two ranks by RANK (local rank on one node), once started."""
    return {r: psutil.Process(pid) for r, pid in enumerate(_attempt_pids(job, proc))}


def _ready_spares(job: Path, proc: subprocess.Popen[str], seen: int) -> dict[int, int]:
    """local rank -> pid of the two spares of ``standby_ready`` events ``seen`` and ``seen+1``,
    once both are logged."""
    ready = _wait(lambda: job_events(job, "standby_ready")[seen:seen + 2]
                  if len(job_events(job, "standby_ready")) >= seen + 2 else None, proc)
    return {e["local_rank"]: e["pid"] for e in ready}  # type: ignore[union-attr]


def _stop_then_kill(job: Path, proc: subprocess.Popen[str], rank: psutil.Process, seen: int,
                    after_step: int) -> dict[int, int]:
    """Once a step past ``after_step`` is committed, SIGSTOP ``rank`` (training stops: the
    spares may take long to import torch on a busy machine), wait for both spares, then
    SIGKILL it. Returns the spares, the next attempt's ranks."""
    _wait(lambda: any(e["step"] > after_step for e in job_events(job, "commit")), proc)
    rank.send_signal(signal.SIGSTOP)
    spares = _ready_spares(job, proc, seen)
    rank.kill()
    return spares


def _ddp_ends_as_plain(tmp_path: Path, proc: subprocess.Popen[str],
                       plain: subprocess.CompletedProcess[str]) -> Run:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "got.pt"))
    assert [l for l in out.splitlines() if l.startswith("epoch")] == \
        [l for l in plain.stdout.splitlines() if l.startswith("epoch")]
    return Run(0, out, err, tmp_path / "j")


def _resumed_by_attempt(job: Path) -> dict[int, dict[int, dict]]:
    """attempt -> rank -> that rank's ``resumed`` event."""
    out: dict[int, dict[int, dict]] = {}
    for e in job_events(job, "resumed"):
        out.setdefault(e["attempt"], {})[e["rank"]] = e
    return out


@pytest.mark.slow
def test_two_ranks_started_by_cfrun_restart_from_a_spare_each_twice_as_plain_torchrun(tmp_path):
    """``--launcher python --nproc-per-node 2`` (gloo, DDP): rank 1 SIGKILLed, then rank 0 of
    the next attempt; each time both spares were ready, and the next attempt's ranks are those
    spares (their pids are the ``standby_ready`` pids; ``attempt_start`` and both ``resumed``
    say ``warm``), resumed from the newest commit; the run ends bit-identical with the plain
    ``torchrun --standalone --nproc-per-node 2`` run."""
    plain = _plain_torchrun(tmp_path)
    job = tmp_path / "j"
    proc = _start_ddp(tmp_path)
    try:
        first = _stop_then_kill(job, proc, _cold_ranks(proc, job)[1], 0, 0)
        _wait(lambda: len(_resumed_by_attempt(job).get(1, {})) == 2, proc)
        # a spare not promoted is killed at the attempt's start: these live on as its ranks,
        # and no rank was started cold
        assert all(psutil.Process(pid).is_running() for pid in first.values())
        assert not [c for c in psutil.Process(proc.pid).children()
                    if c.cmdline()[1:2] == [DDP]]
        resumed_at = _resumed_by_attempt(job)[1][0]["step"]
        second = _stop_then_kill(job, proc, psutil.Process(first[0]), 2, resumed_at)
        run = _ddp_ends_as_plain(tmp_path, proc, plain)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert set(first.values()).isdisjoint(second.values())
    starts = job_events(job, "attempt_start")
    assert [(bool(s.get("warm")), s.get("warm_ranks")) for s in starts] == [
        (False, None), (True, [0, 1]), (True, [0, 1])], starts
    resumed = _resumed_by_attempt(job)
    assert all(resumed[a][r].get("warm") for a in (1, 2) for r in (0, 1)), resumed
    for a in (1, 2):  # the spare's go, its "process start", came after the attempt began
        for r in (0, 1):
            assert resumed[a][r]["process_start_unix_s"] >= starts[a]["t_unix_s"] - 0.01
    assert_resumed_from_newest(run, 2)
    assert_resumed_from_newest(run, 2, rank=1)
    failures = job_events(job, "failure")
    assert len(failures) == 2, failures


@pytest.mark.extended  # a killed spare: test_a_killed_spare_is_replaced_and_the_restart_is_exact
def test_a_killed_spare_of_one_rank_starts_that_rank_cold_and_the_run_is_exact(tmp_path):
    """Both spares ready, then local rank 1's spare SIGKILLed just before rank 0 is: the
    restart promotes rank 0's spare and starts rank 1 cold (``warm_ranks`` [0]; rank 1's
    ``resumed`` not warm), and the run still ends bit-identical with plain torchrun."""
    plain = _plain_torchrun(tmp_path)
    job = tmp_path / "j"
    proc = _start_ddp(tmp_path)
    try:
        ranks = _cold_ranks(proc, job)
        _wait(lambda: job_events(job, "commit"), proc)
        ranks[0].send_signal(signal.SIGSTOP)
        spares = _ready_spares(job, proc, 0)
        os.kill(spares[1], signal.SIGKILL)
        ranks[0].kill()
        _ddp_ends_as_plain(tmp_path, proc, plain)
    finally:
        if proc.poll() is None:
            proc.kill()
    starts = job_events(job, "attempt_start")
    assert [(bool(s.get("warm")), s.get("warm_ranks")) for s in starts] == [
        (False, None), (False, [0])], starts
    resumed = _resumed_by_attempt(job)[1]
    assert resumed[0].get("warm") and not resumed[1].get("warm"), resumed


CPU_AT_IMPORT = ("\nimport torch\nimport time as _t\nwith open(os.environ['CPU_LOG'], 'a') as _f:\n"
                 "    _f.write(f'{os.getpid()} {_t.process_time()}\\n')\ndel _t, _f\n")
"""Put after ``import torch`` in a copy of train_tiny.py: the CPU seconds its process had spent
once torch was imported, appended to ``$CPU_LOG``."""


@pytest.mark.launched  # the one-node default launcher (local), as users launch
def test_a_job_imports_torch_once_however_often_it_restarts(tmp_path):
    """Issue 36 (and 35): a rank's restarts cost a fork, not an interpreter's start and import.
    Two SIGKILLs of the rank under the default launcher, each once the spare said it was ready
    (the rank stopped meanwhile: on a busy machine the first spare may take longer to import
    torch than the script takes to reach a fixed step, and a kill before that restarts from a
    spare still importing): once the script's ``import torch`` ran, the first attempt's rank had
    spent about the CPU time the plain run had (importing torch); the next two had spent almost
    none: they ran the script in processes forked from the spare before anything of the job ran
    (CPU time is per process, and starts at 0 in a fork), with pids of their own;
    ``standby_ready`` says ``forked``; each resume came from the newest commit; the run ends
    with the plain ``python`` run's weights and line."""
    for name in ("train_tiny.py", "digits.py"):
        shutil.copy(SCRIPTS / name, tmp_path / name)
    script = tmp_path / "train_tiny.py"
    script.write_text(script.read_text().replace("\nimport torch\n", CPU_AT_IMPORT, 1))
    plain_log, log = tmp_path / "plain-cpu.txt", tmp_path / "cpu.txt"
    plain = subprocess.run([sys.executable, "train_tiny.py", "--epochs", "3", "--out",
                            "plain.pt"], cwd=tmp_path, env=clean_env({"CPU_LOG": str(plain_log)}),
                           capture_output=True, text=True, timeout=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    run = _two_warm_kills(tmp_path, ["--interval", "5", "train_tiny.py", "--epochs", "3",
                                     "--out", "got.pt"], env={"CPU_LOG": str(log)},
                          launcher="auto")
    assert run.returncode == 0, run.stderr[-3000:]
    starts = [line.split() for line in log.read_text().splitlines()]
    assert len(starts) == 3 and len({pid for pid, _ in starts}) == 3, starts
    cpu_s = [float(cpu) for _, cpu in starts]
    plain_cpu_s = float(plain_log.read_text().split()[1])
    # a process that imported torch itself: as the plain run's (1.3-4 CPU-s on the machines
    # seen); a fork of the spare: its page faults, the script's compile and first imports
    assert plain_cpu_s >= 0.5 and cpu_s[0] >= 0.5 * plain_cpu_s, (plain_cpu_s, cpu_s)
    assert all(c < 0.25 * plain_cpu_s for c in cpu_s[1:]), (plain_cpu_s, cpu_s)
    ready = job_events(run.job_dir, "standby_ready")
    assert ready and all(e.get("forked") for e in ready), ready
    assert [int(pid) for pid, _ in starts[1:]] == [
        e["pids"][0] for e in job_events(run.job_dir, "attempt_pids")][1:]
    assert_resumed_from_newest(run, 2)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "got.pt"))
    assert final_line(run.stdout) == final_line(plain.stdout)


@pytest.mark.launched  # the one-node default launcher (local), as users launch
def test_a_loop_in_a_thread_resumes_and_ends_the_script_when_the_thread_does(tmp_path):
    """A script whose main thread starts a non-daemon thread that runs the training loop and
    returns at once (Python ends the process when that thread ends), SIGKILLed after step 30:
    the next attempt's resume reaches the loop in the thread (``threading.settrace`` beside
    ``sys.settrace``: :meth:`cfrun.rank.resume_loops.LoopArrival.arm`) and goes on from the
    newest commit instead of training from step 0 again; that attempt's rank, a spare forked
    at the first one's go, writes cfrun's end mark after the thread's last step, as a cold
    rank does where the interpreter joins the thread before any ``atexit`` handler
    (:func:`cfrun.rank.spare._join_threads`); the weights and the last line equal the plain
    ``python`` run's. Before: the resumed attempt trained from step 0 and said at its end that
    the checkpoint was not restored; the end mark said ``clean`` at step 0, written when the
    main thread's code returned."""
    script = str(SCRIPTS / "train_in_thread.py")
    plain = subprocess.run([sys.executable, script, "plain.pt"], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    run = run_cfrun(["--interval", "5", "--inject-crash", "30", "--job-dir", "j", script,
                     "out.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    [resumed] = assert_resumed_from_newest(run, 1)
    assert "not restored" not in run.stderr, run.stderr[-3000:]
    again = [e["step"] for e in job_events(run.job_dir, "checkpoint") if e["attempt"] == 1]
    assert again and min(again) > resumed, (resumed, again)  # no step trained twice over
    ready = job_events(run.job_dir, "standby_ready")
    assert any(e.get("forked") for e in ready), ready  # attempt 1's rank was a spare
    marks = [json.loads(p.read_text()) for p in (run.job_dir / "ended").glob("*.json")]
    assert marks == [{"clean": True, "preempted": False, "step": 60}], marks
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "out.pt"))
    assert final_line(run.stdout) == final_line(plain.stdout)
