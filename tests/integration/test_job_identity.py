"""Job identity (issue 13, item 4) and a dead supervisor in ``cfrun status`` (item 8), with real
processes: a changed command is refused with one line and exit 2 and nothing in the job dir
changes; ``--accept-changed-command`` goes on and records it; the default job dir and the job's
name at a peer and at level 2 keep jobs apart; a checkpoint of another job id is never
installed; ``status`` after a SIGKILL of cfrun says the supervisor is gone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import SCRIPTS, clean_env, resumable_steps, run_cfrun
from test_peer import Peer, wait_event, write_token

from cfrun.codec.checkpoint import committed_steps
from cfrun.contract.errors import EXIT_BAD_INPUT
from cfrun.contract.jobdir import step_dir_name
from cfrun.peer.protocol import PeerClient

pytestmark = pytest.mark.timeout(300)

TRAIN = """\
import argparse
import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--out", default="out.pt")
a = p.parse_args()
torch.manual_seed(0)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=a.lr)
for it in range(a.steps):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.save(model.state_dict(), a.out)
print("FINAL done")
"""


def _script(directory: Path, name: str = "train.py") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(TRAIN)
    return path


def _listing(root: Path) -> list[tuple[str, int, int, int]]:
    """Every path under ``root`` with its mode, size and modification time (ns)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            out.append((str(p.relative_to(root)), st.st_mode, st.st_size, st.st_mtime_ns))
    return sorted(out)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("cfrun: error:")]


def _events(job: Path, kind: str) -> list[dict]:
    path = job / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == kind]


def _identity(job: Path) -> dict:
    return json.loads((job / "identity.json").read_text())


# ---------------------------------------------------------------------- a changed command


UNFINISHED = ["--inject-crash", "14@0", "--max-restarts", "0"]
"""A first run that stops at step 14 (exit 4) with its checkpoints: a job to go on with."""


def test_changed_arguments_are_refused_with_one_line_and_the_job_dir_untouched(tmp_path):
    """In the job dir of an unfinished job with a checkpoint (the default job dir tells other
    arguments apart: here one job dir named for both)."""
    script = _script(tmp_path)
    first = run_cfrun(["--interval", "5", "--job-dir", "j", *UNFINISHED, str(script), "--lr",
                       "0.1", "--steps", "20"], cwd=tmp_path)
    assert first.returncode == 4, first.stderr[-3000:]
    job = tmp_path / "j"
    assert committed_steps(job / "checkpoints")
    before = _listing(job)
    dry = run_cfrun(["--dry-run", "--interval", "5", "--job-dir", "j", str(script), "--lr",
                     "0.2", "--steps", "20"], cwd=tmp_path)
    assert json.loads(dry.stdout)["job_dir"].startswith("refused (exit 2)"), dry.stdout
    again = run_cfrun(["--interval", "5", "--job-dir", "j", str(script), "--lr", "0.2",
                       "--steps", "20"], cwd=tmp_path)
    assert again.returncode == EXIT_BAD_INPUT == 2, again.stderr[-3000:]
    [line] = _errors(again.stderr)
    assert "argument --lr: 0.1 -> 0.2" in line, line
    assert "new --job-dir" in line and "--accept-changed-command" in line, line
    assert "FINAL" not in again.stdout
    assert _listing(job) == before  # nothing created, written or touched
    # the same command still resumes, as before
    same = run_cfrun(["--interval", "5", "--job-dir", "j", str(script), "--lr", "0.1",
                      "--steps", "20"], cwd=tmp_path)
    assert same.returncode == 0, same.stderr[-3000:]
    assert _events(job, "resumed")


def test_a_finished_jobs_edited_script_starts_over_with_its_checkpoints_kept_aside(tmp_path):
    """Issue 37, item 2: edit and rerun after a finished job is a new run from step 0 (bit for
    bit the edited script's plain run), said in one line naming where the finished run's
    checkpoints went; they are all there, untouched."""
    script = _script(tmp_path)
    args = ["--interval", "5", "--job-dir", "j", str(script), "--steps", "12"]
    first = run_cfrun(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    job = tmp_path / "j"
    old = {p.relative_to(job / "checkpoints"): p.read_bytes()
           for p in (job / "checkpoints").rglob("*") if p.is_file()}
    assert committed_steps(job / "checkpoints")
    script.write_text(TRAIN.replace("lr=a.lr", "lr=a.lr * 2"))
    dry = run_cfrun(["--dry-run", *args], cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert json.loads(dry.stdout)["job_dir"].startswith("start at step 0: the job finished")
    edited = run_cfrun(args, cwd=tmp_path)
    assert edited.returncode == 0, edited.stderr[-3000:]
    assert "FINAL done" in edited.stdout
    [line] = [ln for ln in edited.stderr.splitlines() if "a new run starts at step 0" in ln]
    assert "finished at step 12" in line and "script edited" in line, line
    [aside] = [p for p in job.iterdir() if p.name.startswith("checkpoints.previous-")]
    assert line.endswith(f"kept in {aside}"), line
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} \
        == old
    assert not _events(job, "resumed")  # from step 0, not from the finished run's weights
    [changed] = _events(job, "command_changed")
    assert changed["why"] == "finished job, started over"
    assert changed["previous_checkpoints"] == str(aside)
    assert _identity(job)["fingerprints"] == [changed["fingerprint"]]
    plain = subprocess.run([sys.executable, str(script), "--steps", "12", "--out", "plain.pt"],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]
    import torch
    from conftest import assert_bit_identical

    assert_bit_identical(torch.load(tmp_path / "plain.pt", weights_only=True),
                         torch.load(tmp_path / "out.pt", weights_only=True))
    # the edited command is now the job's, finished: a third run has nothing to do
    third = run_cfrun(args, cwd=tmp_path)
    assert third.returncode == 0 and "nothing to do" in third.stderr, third.stderr[-3000:]


@pytest.mark.slow
def test_an_edited_script_is_refused_and_the_accept_flag_resumes_and_records_it(tmp_path):
    """An unfinished job (a finished one starts over: above)."""
    script = _script(tmp_path)
    first = run_cfrun(["--interval", "5", "--job-dir", "j", *UNFINISHED, str(script),
                       "--steps", "20"], cwd=tmp_path)
    assert first.returncode == 4, first.stderr[-3000:]
    job = tmp_path / "j"
    newest = resumable_steps(job / "checkpoints")[0]
    script.write_text(TRAIN.replace("lr=a.lr", "lr=a.lr * 2"))
    before = _listing(job)
    edited = run_cfrun(["--interval", "5", "--job-dir", "j", str(script), "--steps", "20"],
                       cwd=tmp_path)
    assert edited.returncode == 2, edited.stderr[-3000:]
    [line] = _errors(edited.stderr)
    assert "script edited" in line, line
    assert _listing(job) == before
    accepted = run_cfrun(["--interval", "5", "--job-dir", "j", "--accept-changed-command",
                          str(script), "--steps", "20"], cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert [e["step"] for e in _events(job, "resumed")] == [newest]
    [changed] = _events(job, "command_changed")
    assert changed["changed"][0].startswith("script edited")
    identity = _identity(job)
    assert len(identity["fingerprints"]) == 2 and identity["fingerprint"] == changed["fingerprint"]
    config = json.loads((job / "config.json").read_text())
    assert config["command_changes"][0]["changed"] == changed["changed"]
    assert config["job_id"] == identity["job_id"]
    # the accepted command is now the job's: it resumes without the flag
    after = run_cfrun(["--interval", "5", "--job-dir", "j", str(script), "--steps", "20"],
                      cwd=tmp_path)
    assert after.returncode == 0, after.stderr[-3000:]
    assert len(_events(job, "command_changed")) == 1


def test_two_scripts_with_one_file_name_get_two_default_job_dirs(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        # a script that trains: a run that trains nothing keeps no default job dir
        shutil.copy(SCRIPTS / "train_argv.py", tmp_path / d / "train.py")
    for d in ("a", "b", "a"):  # the same script again: the same job dir
        run = run_cfrun(["--rerun", f"{d}/train.py", "--steps", "3"], cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
    jobs = sorted((tmp_path / "cfrun-jobs").iterdir())
    assert len(jobs) == 2 and all(j.name.startswith("train-") for j in jobs)
    scripts = {json.loads((j / "config.json").read_text())["script"] for j in jobs}
    assert scripts == {str(tmp_path / "a" / "train.py"), str(tmp_path / "b" / "train.py")}
    assert sum(len(_events(j, "attempt_start")) for j in jobs) == 3


# ---------------------------------------------------------------------- peer and level 2


@pytest.fixture
def peer(tmp_path):
    token = write_token(tmp_path / "token")
    p = Peer(tmp_path, str(tmp_path / "l2"), token)
    yield p, token
    p.kill()


@pytest.mark.slow
def test_two_jobs_with_one_job_dir_name_stay_apart_on_a_peer(tmp_path, peer):
    """Job A in x/j and job B in y/j (another learning rate) on one peer: two names, two
    level-2 prefixes, B never installs A's checkpoint; B on a fresh node (its job dir gone,
    nothing but the token) finds its own."""
    p, token = peer
    script = _script(tmp_path)
    common = ["--interval", "5", "--peer", p.address, "--peer-token-file", str(token)]
    a = run_cfrun([*common, "--job-dir", "x/j", str(script), "--lr", "0.1"], cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    b_argv = [*common, "--job-dir", "y/j", str(script), "--lr", "0.2"]
    b = run_cfrun(b_argv, cwd=tmp_path)
    assert b.returncode == 0, b.stderr[-3000:]
    ida, idb = _identity(tmp_path / "x" / "j"), _identity(tmp_path / "y" / "j")
    assert ida["job_name"] != idb["job_name"] and ida["job_id"] != idb["job_id"]
    assert ida["job_name"].startswith("j-") and idb["job_name"].startswith("j-")
    assert not _events(tmp_path / "y" / "j", "fetched")  # B did not take A's checkpoint
    assert not _events(tmp_path / "y" / "j", "resumed")
    for ident in (ida, idb):
        wait_event(tmp_path / ("x" if ident is ida else "y") / "j", "durable")
        steps = committed_steps(tmp_path / "l2" / ident["job_name"])
        assert steps
        for step in steps:
            manifest = json.loads((tmp_path / "l2" / ident["job_name"] / step_dir_name(step)
                                   / "manifest.json").read_text())
            assert manifest["meta"]["job_id"] == ident["job_id"]
    # B's node is lost with its job dir: the same command with the same token (its seal key
    # derives from the token and B's name, issue 32) finds B's checkpoint, not A's
    shutil.rmtree(tmp_path / "y")
    again = run_cfrun(b_argv, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _identity(tmp_path / "y" / "j")["job_id"] == idb["job_id"]
    # B's final checkpoint (its script's end) and the newest one a resume can start from
    *final, fetched = _events(tmp_path / "y" / "j", "fetched")
    assert len(final) <= 1 and all(f["step"] > fetched["step"] for f in final), final
    assert [e["step"] for e in _events(tmp_path / "y" / "j", "resumed")] == [fetched["step"]]


@pytest.mark.slow
def test_a_job_with_a_key_of_its_own_installs_only_its_key_s_seals(tmp_path, peer):
    """--job-key-file with a peer (issue 32): the job's checkpoints are sealed under that key,
    not the token's. Its node lost, the same command with the token alone refuses each of them
    (fetch_failed events naming --job-key-file) and stops with exit 5 before its first step,
    instead of starting over and crowding them out of the peer's retention (a CI run saw the
    token-only run's steps evict the keyed ones); with the key file it resumes."""
    p, token = peer
    script = _script(tmp_path)
    key = tmp_path / "job.secret"
    key.write_text("5a" * 32 + "\n")
    key.chmod(0o600)
    argv = ["--interval", "5", "--peer", p.address, "--peer-token-file", str(token),
            "--job-dir", "j", str(script), "--steps", "12"]
    first = run_cfrun(["--job-key-file", str(key), *argv], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "j" / "job.key").read_text().strip() == "5a" * 32
    job = _identity(tmp_path / "j")["job_name"]
    shutil.rmtree(tmp_path / "j")

    def held() -> list[int]:  # the steps the peer holds of the job
        c = PeerClient(("127.0.0.1", p.port), token.read_text().strip().encode())
        return sorted(e["step"] for e in c.list(job)["checkpoints"])

    peer_steps = held()
    token_only = run_cfrun(argv, cwd=tmp_path)
    assert token_only.returncode == 5, token_only.stderr[-3000:]
    error = token_only.stderr.strip().splitlines()[-1]
    assert "not starting over" in error and "--job-key-file" in error, error
    failed = _events(tmp_path / "j", "fetch_failed")
    assert failed and all("not sealed by this job" in e["error"]
                          and "--job-key-file" in e["error"] for e in failed), failed
    assert not _events(tmp_path / "j", "fetched") and not _events(tmp_path / "j", "first_step")
    assert held() == peer_steps  # nothing crowded out
    shutil.rmtree(tmp_path / "j")
    with_key = run_cfrun(["--job-key-file", str(key), *argv], cwd=tmp_path)
    assert with_key.returncode == 0, with_key.stderr[-3000:]
    assert _events(tmp_path / "j", "fetched") and _events(tmp_path / "j", "resumed")
    assert not _events(tmp_path / "j", "fetch_failed")


@pytest.mark.slow
def test_a_new_job_dir_beside_level2_steps_it_cannot_verify_stops_and_keeps_them(tmp_path, peer):
    """A job with --job-key-file and a peer, whose peer flushed its steps to level 2 and is
    gone. On a new machine the same command without the key file (--persist-to level 2 and
    the token) can verify none of them: it stops with exit 5 before its first step, in a line
    naming --job-key-file, and level 2 keeps every file as it was; with the key file it
    resumes from level 2."""
    p, token = peer
    key = tmp_path / "job.secret"
    key.write_text("3c" * 32 + "\n")
    key.chmod(0o600)
    script = _script(tmp_path)
    l2 = tmp_path / "l2"
    first = run_cfrun(["--interval", "5", "--job-dir", "j", "--job-key-file", str(key), "--peer",
                       p.address, "--peer-token-file", str(token), str(script), "--steps", "30"],
                      cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    job = _identity(tmp_path / "j")["job_name"]
    p.stop()  # flushed what it held
    assert committed_steps(l2 / job)
    shutil.rmtree(tmp_path / "j")
    before = _listing(l2)
    argv = ["--interval", "5", "--job-dir", "j", "--peer-token-file", str(token), "--persist-to",
            str(l2), str(script), "--steps", "30"]
    again = run_cfrun(argv, cwd=tmp_path)
    assert again.returncode == 5, again.stderr[-3000:]
    [error] = _errors(again.stderr)
    assert "not starting over" in error and "--job-key-file" in error, error
    assert not _events(tmp_path / "j", "first_step") and not _events(tmp_path / "j", "fetched")
    assert {e["source"] for e in _events(tmp_path / "j", "fetch_failed")} == {"level2"}
    assert _listing(l2) == before
    shutil.rmtree(tmp_path / "j")
    with_key = run_cfrun(["--job-key-file", str(key), *argv], cwd=tmp_path)
    assert with_key.returncode == 0, with_key.stderr[-3000:]
    assert _events(tmp_path / "j", "fetched") and _events(tmp_path / "j", "resumed")


@pytest.mark.slow
def test_a_level2_checkpoint_of_another_job_id_is_not_installed(tmp_path, peer):
    """Job a's flushed checkpoints copied under job b's name at level 2 (a mixed-up store):
    b's agent refuses each with a fetch_failed event naming the job ids, and b trains from
    scratch."""
    p, token = peer
    script = _script(tmp_path)
    a = run_cfrun(["--interval", "5", "--job-dir", "ja", "--job-name", "a", "--peer",
                   p.address, "--peer-token-file", str(token), str(script)], cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    wait_event(tmp_path / "ja", "durable")
    p.stop()  # flushed what it held
    steps = committed_steps(tmp_path / "l2" / "a")
    assert steps
    shutil.copytree(tmp_path / "l2" / "a", tmp_path / "l2" / "b")
    b = run_cfrun(["--interval", "5", "--job-dir", "jb", "--job-name", "b", "--persist-to",
                   str(tmp_path / "l2"), str(script)], cwd=tmp_path)
    assert b.returncode == 0, b.stderr[-3000:]
    failed = _events(tmp_path / "jb", "fetch_failed")
    assert [e["step"] for e in failed] == steps  # each refused, newest first
    ida = _identity(tmp_path / "ja")["job_id"]
    assert all(f"another job (job id {ida}" in e["error"] for e in failed), failed
    assert all(e["source"] == "level2" for e in failed)
    assert not _events(tmp_path / "jb", "fetched") and not _events(tmp_path / "jb", "resumed")


@pytest.mark.slow
def test_a_step_planted_at_level_2_without_the_job_key_is_not_installed(tmp_path, peer):
    """Issue 24, item 2: a writer of the level-2 store (the bucket, the NFS directory) planted
    a newer step made of the job's own files (the job id and command hashes are public), and
    with --persist-to and no live peer the job resumed from it. Now every checkpoint from
    outside the job dir needs the seals of the job's key: the planted step is refused with a
    fetch_failed event, the job's own newest level-2 step is installed, and the job ends."""
    p, token = peer
    script = _script(tmp_path)
    argv = ["--interval", "5", "--job-dir", "ja", "--job-name", "a", "--peer", p.address,
            "--peer-token-file", str(token), "--persist-to", str(tmp_path / "l2"),
            "--max-restarts", "0", "--inject-crash", "17", str(script), "--steps", "30"]
    first = run_cfrun(argv, cwd=tmp_path)
    assert first.returncode == 4, first.stderr[-3000:]
    # any durable step: a loaded machine may defer the one due at 10 or 15 past the crash
    durable = wait_event(tmp_path / "ja", "durable", lambda e: e["step"] >= 5)["step"]
    p.stop()  # flushed what it held
    newest = committed_steps(tmp_path / "l2" / "a")[0]
    assert newest >= durable
    planted = tmp_path / "l2" / "a" / step_dir_name(25)
    shutil.copytree(tmp_path / "l2" / "a" / step_dir_name(newest), planted)
    manifest = json.loads((planted / "manifest.json").read_text())
    manifest["step"] = 25
    (planted / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(tmp_path / "ja" / "checkpoints")  # the node's disk is lost, not its key
    run = run_cfrun(["resume", "ja"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = _events(tmp_path / "ja", "fetch_failed")
    assert [e["step"] for e in failed] == [25], failed
    assert "not sealed by this job" in failed[0]["error"]
    [fetched] = _events(tmp_path / "ja", "fetched")
    assert (fetched["source"], fetched["step"]) == ("level2", newest)


@pytest.mark.slow
def test_a_checkpoint_of_another_job_in_the_job_dir_is_set_aside_not_resumed(tmp_path):
    """Job a's newer checkpoint copied into job b's job dir: b moves it aside
    (``foreign-step-*``, a foreign_checkpoint event) and resumes from its own."""
    script = _script(tmp_path)
    a = run_cfrun(["--interval", "5", "--job-dir", "ja", "--job-name", "a", str(script),
                   "--steps", "30"], cwd=tmp_path)  # newer than b's even with deferrals
    assert a.returncode == 0, a.stderr[-3000:]
    b_argv = ["--interval", "5", "--job-dir", "jb", "--job-name", "b", str(script), "--steps",
              "7"]
    b = run_cfrun(b_argv, cwd=tmp_path)
    assert b.returncode == 0, b.stderr[-3000:]
    theirs = committed_steps(tmp_path / "ja" / "checkpoints")[0]
    ours = resumable_steps(tmp_path / "jb" / "checkpoints")[0]
    assert theirs > ours
    shutil.copytree(tmp_path / "ja" / "checkpoints" / step_dir_name(theirs),
                    tmp_path / "jb" / "checkpoints" / step_dir_name(theirs))
    again = run_cfrun(["--rerun", *b_argv], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    [foreign] = _events(tmp_path / "jb", "foreign_checkpoint")
    assert foreign["step"] == theirs and foreign["job_id"] == _identity(tmp_path / "ja")["job_id"]
    assert Path(foreign["path"]).name.startswith(f"foreign-{step_dir_name(theirs)}-")
    assert Path(foreign["path"]).is_dir()
    assert [e["step"] for e in _events(tmp_path / "jb", "resumed")] == [ours]


# ---------------------------------------------------------------------- status


@pytest.mark.slow
def test_status_after_a_sigkill_of_cfrun_says_the_supervisor_is_gone(tmp_path):
    argv = [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j",
            str(SCRIPTS / "slow_steps.py"), "100000", "out.pt", "0.05"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    job = tmp_path / "j"
    try:
        wait_event(job, "checkpoint", timeout_s=120, proc=proc)
        live = run_cfrun(["status", "--json", "j"], cwd=tmp_path)
        assert live.returncode == 0, live.stderr
        assert json.loads(live.stdout)["state"] == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        dead = run_cfrun(["status", "--json", "j"], cwd=tmp_path)
        assert dead.returncode == 0, dead.stderr
        st = json.loads(dead.stdout)
        assert st["is_running"] is False
        assert st["state"] == f"dead (supervisor pid {proc.pid} gone)", st["state"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_leftovers(tmp_path)


def _kill_leftovers(cwd: Path) -> None:
    """Processes of this test's job still running after cfrun's SIGKILL (none expected: the
    launcher's parent-death signal and reaper end them) are killed, so none outlives the test."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = []
        for proc in psutil.process_iter(["cwd"]):
            try:
                if proc.info["cwd"] == str(cwd) and proc.pid != os.getpid():
                    left.append(proc)
            except psutil.Error:
                continue
        if not left:
            return
        time.sleep(0.2)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
