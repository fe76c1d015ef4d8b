"""The local trust boundary of a job (issue 12, items 5 and 6), attacked by a second user.

The attacks a second, unprivileged user of the machine ran against a running job of another:
talking to its persist agent (making it read a file only the owner may read, injecting a
checkpoint), binding the agent's address first, reading or swapping a snapshot slot, reading
config.json. Each must be refused, said in one line, and leave the job unaffected (it commits
checkpoints and exits 0).

The attacker runs as a real second uid (created here with ``useradd`` when missing; these tests
run as root, as CI does) through ``setpriv``, with the system's ``/usr/bin/python3`` and raw
sockets: it imports nothing of cfrun. The job lives under a world-readable directory (like a
home or project directory), so only cfrun's own modes and checks stand between the two users.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SCRIPTS, clean_env

from cfrun.contract import ipc, slots
from cfrun.contract.config import RunConfig
from cfrun.contract.jobdir import JobDir

pytestmark = pytest.mark.timeout(300)
ATTACKER_NAME = "cfrun-attacker"


@dataclass
class Attacker:
    """Runs Python code as the second user (no cfrun import: raw sockets and files)."""

    uid: int
    gid: int
    argv: list[str]

    def popen(self, code: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.argv, "-c", textwrap.dedent(code), *args], cwd="/",
                                env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def run(self, code: str, *args: str, timeout: float = 60) -> dict:
        """Run ``code``; it prints one JSON object, returned here."""
        p = self.popen(code, *args)
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])


def _skip(reason: str) -> None:
    print(f"\ntest_trust: skipped: {reason}", file=sys.stderr)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def attacker() -> Attacker:
    """A second, unprivileged user (``cfrun-attacker``, created if missing)."""
    if os.getuid() != 0:
        _skip("needs root to run code as a second user (CI runs as root)")
    try:
        pw = pwd.getpwnam(ATTACKER_NAME)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", ATTACKER_NAME], check=False, capture_output=True)
        try:
            pw = pwd.getpwnam(ATTACKER_NAME)
        except KeyError:
            pw = pwd.getpwnam("nobody")
    tries = []
    for python in ("/usr/bin/python3", sys.executable):  # the venv's may sit in a 0700 home
        if shutil.which("setpriv"):
            tries.append(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}",
                          "--clear-groups", python])
        if shutil.which("runuser"):
            tries.append(["runuser", "-u", pw.pw_name, "--", python])
    for argv in tries:
        p = subprocess.run([*argv, "-c", "import os; print(os.getuid())"], cwd="/",
                           check=False, capture_output=True, text=True)
        if p.returncode == 0 and p.stdout.strip() == str(pw.pw_uid):
            return Attacker(pw.pw_uid, pw.pw_gid, argv)
    _skip(f"cannot run a python as uid {pw.pw_uid} with setpriv or runuser")
    raise AssertionError


@pytest.fixture
def public() -> Iterator[tuple[Path, Path]]:
    """A world-readable work directory (0755) and a shared-memory base like /dev/shm (1777):
    the attacker reaches both, so cfrun's own modes are what is tested."""
    work = Path(tempfile.mkdtemp(prefix="cfrun-trust-", dir="/tmp"))
    work.chmod(0o755)
    shm_parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    shm = Path(tempfile.mkdtemp(prefix="cfrun-trust-shm-", dir=shm_parent))
    shm.chmod(0o1777)
    yield work, shm
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)


# ---------------------------------------------------------------- the attacker's programs

TALK_TO_AGENT = r"""
import json, socket, struct, sys
address, msgs = sys.argv[1], json.loads(sys.argv[2])
out = []
for msg in msgs:
    r = {"op": msg.get("op"), "step": msg.get("step")}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect("\0" + address)
        r["connected"] = True
        data = json.dumps(msg).encode()
        s.sendall(struct.pack("!I", len(data)) + data)
        head = s.recv(4)
        r["reply"] = (head + s.recv(1 << 16)).decode(errors="replace") if head else None
    except OSError as e:
        r["error"] = type(e).__name__
    finally:
        s.close()
    out.append(r)
print(json.dumps(out))
"""

BIND_AND_COUNT = r"""
import json, os, socket, sys, time
name, stop = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\0" + name)
s.listen(64)
s.settimeout(0.1)
print("BOUND", flush=True)
accepted, received = 0, 0
deadline = time.time() + 280
while not os.path.exists(stop) and time.time() < deadline:
    try:
        c, _ = s.accept()
    except socket.timeout:
        continue
    accepted += 1
    c.settimeout(0.5)
    try:
        received += len(c.recv(1 << 20))
    except OSError:
        pass
    c.close()
print(json.dumps({"accepted": accepted, "received": received}), flush=True)
"""

PROBE_FILES = r"""
import json, os, sys
paths, listdirs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
r = {}
for p in paths:
    try:
        with open(p, "rb") as f:
            f.read(16)
        r[p] = "read"
    except OSError as e:
        r[p] = type(e).__name__
for d in listdirs:
    try:
        os.listdir(d)
        r["ls " + d] = "listed"
    except OSError as e:
        r["ls " + d] = type(e).__name__
print(json.dumps(r))
"""

PLANT = r"""
import json, os, sys
base, prefix, victim = sys.argv[1:4]
evil = os.path.join(base, prefix + "_evil")
os.mkdir(evil)
os.chmod(evil, 0o777)
with open(os.path.join(evil, "rank00000-1-foreign.slot"), "w") as f:
    f.write("attacker's file")
os.symlink(victim, os.path.join(evil, "rank00000-2-link.slot"))
os.symlink(victim, os.path.join(base, prefix + "_link"))
for pid in range(1, 300):  # the old, predictable slot names, pointing at the victim
    os.symlink(victim, os.path.join(base, f"{prefix}-rank00000-{pid}-1.slot"))
print(json.dumps({"planted": True}))
"""

SWAP_SLOT = r"""
import json, os, sys
base, prefix, victim = sys.argv[1:4]
r = {"dirs": 0}
for e in os.listdir(base):
    if not e.startswith(prefix + "_") or e.endswith(("_evil", "_link")):
        continue
    r["dirs"] += 1
    p = os.path.join(base, e)
    for what, fn in [("list", lambda: os.listdir(p)),
                     ("read", lambda: open(os.path.join(p, "rank00000.slot"), "rb")),
                     ("plant", lambda: os.symlink(victim, os.path.join(p, "rank00000-9-x.slot"))),
                     ("rename", lambda: os.rename(p, p + "_moved"))]:
        try:
            fn()
            r[what] = "done"
        except OSError as ex:
            r[what] = type(ex).__name__
print(json.dumps(r))
"""


def _old_agent_name(job_dir: Path) -> str:
    """The agent's abstract name before issue 12: derived from the job dir's path."""
    return "cfrun-agent-" + hashlib.sha1(str(job_dir.absolute()).encode()).hexdigest()[:24]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _wait_for(cond, what: str, proc: subprocess.Popen | None = None, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended while waiting for {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _events(job: Path, kind: str) -> list[dict]:
    path = job / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in (json.loads(line) for line in path.read_text().splitlines() if line)
            if e["event"] == kind]


# ---------------------------------------------------------------- a running job, attacked

def test_a_second_user_cannot_use_read_or_swap_anything_of_a_running_job(attacker, public):
    """(a) read a 0600 file through the agent, (b) inject a checkpoint, (c) bind the agent's
    old, predictable address first, (d) read or swap a slot (and plant links for the cleanup),
    (e) read config.json: every one refused, one line said, the job commits and exits 0."""
    work, shm = public
    job = work / "job"
    stop = work / "stop"
    secret = work / "secret.txt"
    secret.write_text("owner-only-" + os.urandom(8).hex())
    secret.chmod(0o600)
    victim = work / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o644)
    prefix = f"cfrun-{hashlib.sha1(str(job).encode()).hexdigest()[:12]}"
    bait = work / "bait.slot"  # the attacker's forged slot bytes (its own file)

    # before the job: plant links and a foreign directory under the job's slot prefix, and
    # bind the address the agent used to derive from the job dir
    assert attacker.run(PLANT, str(shm), prefix, str(victim))["planted"]
    squatter = attacker.popen(BIND_AND_COUNT, _old_agent_name(job), str(stop))
    assert squatter.stdout is not None and squatter.stdout.readline().strip() == "BOUND"

    env = clean_env({"CFRUN_SHM_DIR": str(shm)})
    proc = subprocess.Popen([sys.executable, "-m", "cfrun", "--interval", "5", "--max-restarts",
                             "0", "--job-dir", str(job), str(SCRIPTS / "train_until_file.py"),
                             str(stop), "15", str(work / "out.pt")], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _events(job, "commit"), "a first commit", proc)
        record = ipc.read_agent_record(job)
        assert record.address != _old_agent_name(job)
        assert record.slot_dir and Path(record.slot_dir).parent == shm

        # modes, as the owner sees them
        assert _mode(job) == 0o700 and _mode(job / "checkpoints") == 0o700
        for name in ("events.jsonl", "job.lock", "agent.json"):
            assert _mode(job / name) == 0o600, name
        private = Path(record.slot_dir)
        assert _mode(private) == 0o700
        _wait_for(lambda: any(private.iterdir()), "a slot")
        assert all(_mode(p) == 0o600 for p in private.iterdir())

        # (e) config.json, events, agent.json and the job dir itself
        probe = attacker.run(PROBE_FILES, json.dumps([str(job / n) for n in (
            "config.json", "events.jsonl", "agent.json", "job.lock")] + [str(secret)]),
            json.dumps([str(job), str(private)]))
        assert set(probe.values()) == {"PermissionError"}, probe

        # (a) + (b): as if it had found the address in /proc/net/unix
        bait.write_bytes(b"\xff" * 4096)
        os.chown(bait, attacker.uid, attacker.gid)
        forged = {"op": "persist", "rank": 0, "world_size": 1, "doc": {"meta": {}},
                  "t_trigger_unix_s": time.time()}
        talks = attacker.run(TALK_TO_AGENT, record.address, json.dumps([
            {"op": "hello", "rank": 0},
            {**forged, "step": 99999998, "slot": str(secret), "nbytes": 16},
            {**forged, "step": 99999999, "slot": str(bait), "nbytes": 4096}]))
        for t in talks:
            assert t.get("reply") is None, t  # closed without a word: nothing queued

        # (d) slots: no listing, reading, planting or renaming in the private directory
        swap = attacker.run(SWAP_SLOT, str(shm), prefix, str(victim))
        assert swap["dirs"] == 1, swap
        assert {swap[k] for k in ("list", "read", "plant", "rename")} == {"PermissionError"}, swap
        step_attacked = max(e["step"] for e in _events(job, "commit"))
        stop.touch()
        out, err = proc.communicate(timeout=240)
    finally:
        stop.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        squat_out, _ = squatter.communicate(timeout=30)

    # the job is unaffected
    assert proc.returncode == 0, err[-3000:]
    assert "FINAL" in out
    commits = [e["step"] for e in _events(job, "commit")]
    assert max(commits) > step_attacked, commits
    assert all(s < 1000 for s in commits), commits  # no forged step
    steps = sorted(int(p.name.split("-")[1]) for p in (job / "checkpoints").glob("step-*"))
    assert steps and all(s < 1000 for s in steps), steps
    for f in (job / "checkpoints").rglob("*"):
        if f.is_file():
            assert secret.read_bytes() not in f.read_bytes(), f
            assert b"\xff" * 4096 not in f.read_bytes(), f
    # (a)/(b) refused, said once in one line, recorded once
    said = [line for line in err.splitlines()
            if f"refused a connection to the agent from uid {attacker.uid}" in line]
    assert len(said) == 1, err[-3000:]
    assert said[0].endswith("the job is unaffected"), said  # a user reading it need not act
    assert [e["uid"] for e in _events(job, "agent_refused")] == [attacker.uid]
    assert not _events(job, "persist_refused")  # nothing of the attacker's reached the queue
    # (c) the old name bound first caught nothing
    assert json.loads(squat_out.strip().splitlines()[-1]) == {"accepted": 0, "received": 0}
    # (d) the planted links were never followed; the foreign files survive the cleanup
    assert victim.read_text() == "precious"
    assert (shm / f"{prefix}_evil" / "rank00000-1-foreign.slot").read_text() == "attacker's file"
    assert (shm / f"{prefix}_evil" / "rank00000-2-link.slot").is_symlink()
    assert (shm / f"{prefix}_link").is_symlink()
    assert not private.exists()  # the job's own slot directory is gone


# ---------------------------------------------------------------- the agent's address taken

def _cfg(work: Path, **kw) -> RunConfig:
    return RunConfig(script=str(work / "train.py"), script_args=[], job_dir=str(work / "job"),
                     cwd=str(work), **kw)


def test_supervisor_refuses_a_process_that_took_the_agents_address_and_starts_another(
        attacker, public, monkeypatch, capfd):
    """(c) if the attacker knew the name first: the supervisor sees that the process answering
    is not the agent it started (uid and pid), says so in one line, and starts the agent under
    a new name; the attacker receives nothing."""
    from cfrun.supervisor.core import Supervisor

    work, shm = public
    monkeypatch.setenv(slots.ENV_SHM_DIR, str(shm))
    cfg = _cfg(work)
    JobDir(cfg.job_dir).create()
    taken = ipc.new_agent_address()
    stop = work / "stop"
    squatter = attacker.popen(BIND_AND_COUNT, taken, str(stop))
    assert squatter.stdout is not None and squatter.stdout.readline().strip() == "BOUND"
    names = iter([taken])
    real_new = ipc.new_agent_address
    monkeypatch.setattr(ipc, "new_agent_address", lambda: next(names, None) or real_new())
    sup = Supervisor(cfg)
    try:
        sup._start_agent()
        assert sup.agent is not None and sup.agent.poll() is None
        record = ipc.read_agent_record(cfg.job_dir)
        assert record.pid == sup.agent.pid and record.address != taken
        with ipc.connect(cfg.job_dir) as sock:  # the job goes on: its agent answers
            ipc.send(sock, {"op": "hello", "rank": 0})
            assert ipc.recv(sock)["op"] == "ready"
    finally:
        sup._stop_agent()
        stop.touch()
        squat_out, _ = squatter.communicate(timeout=30)
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if f"refused the agent at {taken}" in line]
    assert len(said) == 1 and f"uid {attacker.uid}" in said[0], err
    assert json.loads(squat_out.strip().splitlines()[-1])["received"] == 0


def test_a_rank_refuses_an_agent_of_another_user(attacker, public, capfd):
    """(c) a stale agent.json whose name another user bound (after the agent died): the client
    check refuses it, once said in one line however often the rank retries."""
    work, _ = public
    job = work / "job"
    JobDir(job).create()
    taken = ipc.new_agent_address()
    stop = work / "stop"
    squatter = attacker.popen(BIND_AND_COUNT, taken, str(stop))
    assert squatter.stdout is not None and squatter.stdout.readline().strip() == "BOUND"
    try:
        ipc.write_agent_record(job, ipc.AgentRecord(os.getpid(), taken))
        for _ in range(3):
            with pytest.raises(ipc.RefusedPeer):
                ipc.connect(job, timeout_s=2.0)
    finally:
        stop.touch()
        squat_out, _ = squatter.communicate(timeout=30)
    said = [line for line in capfd.readouterr().err.splitlines() if "refused the agent" in line]
    assert len(said) == 1 and f"runs as uid {attacker.uid}" in said[0]
    assert json.loads(squat_out.strip().splitlines()[-1])["received"] == 0


# ---------------------------------------------------------------- the agent's slot checks

@pytest.fixture
def agent(tmp_path: Path, monkeypatch) -> Iterator[tuple[Path, Path]]:
    """A real agent of a one-rank job (``--world-size 1``); yields (job dir, slot dir)."""
    job = tmp_path / "job"
    JobDir(job).create()
    monkeypatch.setenv(slots.ENV_SHM_DIR, str(tmp_path / "shm"))
    proc = subprocess.Popen([sys.executable, "-m", "cfrun.agent", "--job-dir", str(job),
                             "--keep", "10", "--world-size", "1"])
    deadline = time.monotonic() + 60
    while True:
        try:
            ipc.connect(job).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "agent did not start"
            time.sleep(0.05)
    slot_dir = ipc.read_agent_record(job).slot_dir
    assert slot_dir is not None
    yield job, Path(slot_dir)
    proc.terminate()
    proc.wait(30)
    left = [p.name for p in Path(slot_dir).iterdir()] if Path(slot_dir).exists() else []
    assert left == (["foreign.slot"] if os.getuid() == 0 else [])  # not ours: kept


def _persist(job: Path, **msg) -> dict:
    with ipc.connect(job) as sock:
        ipc.send(sock, {"op": "persist", "rank": 0, "world_size": 1, "doc": {"meta": {}},
                        "t_trigger_unix_s": time.time(), **msg})
        return ipc.recv(sock)


def test_agent_accepts_only_private_slots_and_sane_messages(agent, tmp_path):
    """Slots outside the private directory, links, FIFOs, too small or foreign files, and
    steps, ranks, world sizes or sizes that do not fit the job are refused with a reason; the
    agent goes on and commits a valid checkpoint afterwards."""
    job, slot_dir = agent
    assert _mode(slot_dir) == 0o700
    good = slots.create_slot(slot_dir, 0, 4096)
    assert _mode(good) == 0o600
    good.write_bytes(b"\x01" * 4096)
    outside = tmp_path / "outside.slot"
    outside.write_bytes(b"\x02" * 4096)
    link = slot_dir / "rank00000-1-link.slot"
    link.symlink_to(outside)
    fifo = slot_dir / "rank00000-2-fifo.slot"
    os.mkfifo(fifo)
    cases = [
        ("not in this job's private slot directory", {"slot": str(outside), "nbytes": 4096}),
        ("x.slot' is not in this job's", {"slot": str(slot_dir / ".." / "x.slot"), "nbytes": 1}),
        ("is a symbolic link", {"slot": str(link), "nbytes": 4096}),
        ("not a regular file", {"slot": str(fifo), "nbytes": 1}),
        ("fewer than the 8192", {"slot": str(good), "nbytes": 8192}),
        ("step -1", {"step": -1, "slot": str(good), "nbytes": 4096}),
        ("step 99999999999999", {"step": 99999999999999, "slot": str(good), "nbytes": 4096}),
        ("step '5'", {"step": "5", "slot": str(good), "nbytes": 4096}),
        ("rank 1 is outside", {"slot": str(good), "nbytes": 4096, "rank": 1, "world_size": 1}),
        ("world_size 2 is not", {"slot": str(good), "nbytes": 4096, "world_size": 2}),
        ("nbytes 0", {"slot": str(good), "nbytes": 0}),
    ]
    if os.getuid() == 0:
        foreign = slots.create_slot(slot_dir, 0, 4096).rename(slot_dir / "foreign.slot")
        os.chown(foreign, 65534, 65534)
        cases.append(("belongs to uid 65534", {"slot": str(foreign), "nbytes": 4096}))
    for why, msg in cases:
        msg.setdefault("step", 5)
        reply = _persist(job, **msg)
        assert reply["ok"] is False and reply["error"].startswith("refused:"), (why, reply)
        assert why in reply["error"], (why, reply)
    assert len(_events(job, "persist_refused")) == len(cases)
    assert not (job / "checkpoints" / "step-000005").exists()
    reply = _persist(job, step=5, slot=str(good), nbytes=4096)
    assert reply["ok"] is True, reply
    assert (job / "checkpoints" / "step-000005" / "manifest.json").is_file()
    assert outside.read_bytes() == b"\x02" * 4096
