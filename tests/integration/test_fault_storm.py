"""A fault storm: seeded, logged SIGKILLs of every kind of process of a job, and SIGTERMs.

The victims are drawn at random moments from the live process tree of the job: the ranks,
torchrun, the persist agent, the ranks' DataLoader workers, the supervisor's reaper, the
supervisor (cfrun) itself; a SIGTERM to cfrun stands for a spot preemption. After a supervisor
kill or a preemption the same command is run again, as a scheduler would. However the storm
falls, the job must never exit 5 (none of it is the script's failure), must leave no process
behind, and must end bit-identical to an uninterrupted run.

The seed is printed with the kill log on failure; ``STORM_SEED=N`` replays another storm.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, clean_env, ddp_reference, tiny_reference

from cfrun.contract import faults

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.launched]  # as users launch

WEIGHTS = {"rank": 4, "torchrun": 2, "agent": 2, "worker": 2, "reaper": 1, "supervisor": 1,
           "sigterm": 1}
"""How often each kind of victim is drawn (among the kinds alive at that moment)."""


@dataclass
class Storm:
    """One storm over one job: the random source, the log of what was done, the runs' codes."""

    seed: int
    job_dir: Path
    rng: random.Random = field(init=False)
    log: list[str] = field(default_factory=list)
    returncodes: list[int] = field(default_factory=list)
    kills: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def say(self, what: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {what}")

    def report(self) -> str:
        return f"storm seed {self.seed}:\n" + "\n".join(self.log[-80:])

    def commits(self) -> int:
        """Checkpoints committed so far (the job's progress across resumes)."""
        path = self.job_dir / "events.jsonl"
        if not path.exists():
            return 0
        return sum(1 for l in path.read_text().splitlines()
                   if l.strip() and json.loads(l).get("event") == "commit")


def _roles(cfrun: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The job's processes under ``cfrun`` by role (cmdline and parent decide)."""
    out: dict[str, list[psutil.Process]] = {r: [] for r in WEIGHTS}
    out["supervisor"] = out["sigterm"] = [cfrun]
    try:
        children = cfrun.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    torchruns: set[int] = set()
    ranks: set[int] = set()
    for p in children:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "cfrun.agent" in cmd:
            out["agent"].append(p)
        elif "torch.distributed.run" in cmd or "torchrun" in cmd:
            out["torchrun"].append(p)
            torchruns.add(p.pid)
        elif "reaper_main" in cmd:
            out["reaper"].append(p)
    for p in children:  # second pass: parents are known now
        try:
            parent = p.ppid()
        except psutil.Error:
            continue
        if parent in torchruns:
            out["rank"].append(p)
            ranks.add(p.pid)
    for p in children:
        try:
            if p.ppid() in ranks:
                out["worker"].append(p)
        except psutil.Error:
            continue
    return out


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler (``SigCgt`` in /proc/PID/status): cfrun
    holds SIGTERM from its first line (:mod:`cfrun.contract.early_signals`); before that the
    interpreter is still starting and the default action ends it with -15, as any program."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except (OSError, ValueError):
        pass
    return False


def _wait_until_it_catches_sigterm(victim: psutil.Process, proc: subprocess.Popen[bytes],
                                   timeout_s: float = 120.0) -> None:
    """A preemption's SIGTERM goes to cfrun once its first line ran (a fixed second after the
    start was too little on a machine with a load of 15: the interpreter had not started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None \
            and not _catches_sigterm(victim.pid):
        time.sleep(0.05)


def _wait_for_progress(storm: Storm, proc: subprocess.Popen[bytes], since: int,
                       timeout_s: float = 180.0) -> None:
    """Until a checkpoint newer than ``since`` commits (or cfrun exits): the storm never
    outruns the job, so the job always finishes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if storm.commits() > since:
            return
        time.sleep(0.1)


def _run_storm(storm: Storm, argv: list[str], cwd: Path, kills_wanted: int,
               step_delay_s: float = 0.0) -> None:
    """Run ``argv`` (a cfrun command) under the storm until it exits 0; the same command again
    after a killed supervisor or a preemption, as a scheduler would.

    ``step_delay_s`` (fault point ``rank.step_delay_s``) makes each step that much longer in wall
    time, the same bits: a short job then lasts long enough for ``kills_wanted`` kills however
    fast the machine is (kills come every 0.3-2.5 s of wall time)."""
    env = clean_env()
    if step_delay_s:
        env = faults.arm(env, rank__step_delay_s=step_delay_s)
    out = open(cwd / "storm.out", "ab")
    err = open(cwd / "storm.err", "ab")
    try:
        for _ in range(kills_wanted + 5):
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err)
            storm.say(f"start cfrun pid {proc.pid}")
            cfrun = psutil.Process(proc.pid)
            progress_mark = storm.commits()
            strikes = 0  # kills since the job last made progress
            while proc.poll() is None and storm.kills < kills_wanted:
                time.sleep(storm.rng.uniform(0.3, 2.5))
                if strikes >= 2:
                    _wait_for_progress(storm, proc, progress_mark)
                    progress_mark, strikes = storm.commits(), 0
                roles = {r: ps for r, ps in _roles(cfrun).items() if ps}
                if proc.poll() is not None or not roles:
                    break
                kinds = sorted(roles)
                role = storm.rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
                victim = storm.rng.choice(roles[role])
                sig = signal.SIGTERM if role == "sigterm" else signal.SIGKILL
                if role == "sigterm":  # not before the interpreter has run cfrun's first line
                    _wait_until_it_catches_sigterm(victim, proc)
                try:
                    victim.send_signal(sig)
                except psutil.NoSuchProcess:
                    continue
                storm.kills += 1
                strikes += 1
                storm.say(f"#{storm.kills} {sig.name} {role} pid {victim.pid} "
                          f"(commits so far {storm.commits()})")
                if role in ("supervisor", "sigterm"):
                    break
            try:
                code = proc.wait(timeout=400)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError("cfrun did not end\n" + storm.report()) from None
            storm.returncodes.append(code)
            storm.say(f"cfrun exited {code}")
            assert code != 5, "exit 5 under a storm of outside faults\n" + storm.report()
            if code == 0:
                return
            assert code in (75, -signal.SIGKILL), f"exit {code}\n{storm.report()}"
        raise AssertionError("the job never finished\n" + storm.report())
    finally:
        out.close()
        err.close()


def _leftovers(cwd: Path) -> list[str]:
    """Processes still running with ``cwd`` in their command line or as working directory."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid != os.getpid() and (str(cwd) in cmd or p.info["cwd"] == str(cwd)):
                found.append(f"{p.pid} {cmd[:200]}")
        except psutil.Error:
            continue
    return found


def _no_leftovers(cwd: Path, storm: Storm) -> None:
    deadline = time.monotonic() + 30
    while _leftovers(cwd) and time.monotonic() < deadline:  # the reaper's last kills
        time.sleep(0.2)
    assert _leftovers(cwd) == [], "\n".join(_leftovers(cwd)) + "\n" + storm.report()


SEED = int(os.environ.get("STORM_SEED", "20261124"))


def test_storm_on_a_loader_job_with_workers(tmp_path, tmp_path_factory):
    """train_tiny.py, 8 epochs: one rank, two DataLoader workers; 14 faults of every kind."""
    _, ref_state = tiny_reference(tmp_path_factory, epochs=8)
    storm = Storm(SEED, tmp_path / "j")
    argv = [sys.executable, "-m", "cfrun", "--interval", "10", "--job-dir", "j",
            "--max-restarts", "1000", str(SCRIPTS / "train_tiny.py"), "--epochs", "8",
            "--out", "got.pt"]
    _run_storm(storm, argv, tmp_path, kills_wanted=14, step_delay_s=0.05)
    assert storm.kills >= 14, storm.report()
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert_bit_identical(got, ref_state)
    _no_leftovers(tmp_path, storm)
    print(storm.report())  # shown with -s / -rP: what this storm did


def test_storm_on_a_two_rank_ddp_job(tmp_path, tmp_path_factory):
    """train_ddp.py: two ranks (gloo, DDP, DistributedSampler); 8 faults of every kind (22
    with the test above: the suite's storm)."""
    _, ref_state = ddp_reference(tmp_path_factory)
    storm = Storm(SEED + 1, tmp_path / "j")
    argv = [sys.executable, "-m", "cfrun", "--nproc-per-node", "2", "--interval", "10",
            "--keep", "3", "--job-dir", "j", "--max-restarts", "1000",
            str(SCRIPTS / "train_ddp.py"), "got.pt"]
    _run_storm(storm, argv, tmp_path, kills_wanted=8, step_delay_s=0.1)
    assert storm.kills >= 8, storm.report()
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert_bit_identical(got, ref_state)
    _no_leftovers(tmp_path, storm)
    print(storm.report())  # shown with -s / -rP: what this storm did
