"""The peer tier (ACUTE level 1 in a peer's RAM) with real processes on loopback.

A `cfrun peer` process, `cfrun --peer` training runs, real SIGKILLs, a real S3-compatible
server (moto) for level 2, and fuzzed frames from this process.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import xxhash
from conftest import (
    SCRIPTS,
    Run,
    assert_bit_identical,
    clean_env,
    ddp_reference,
    final_line,
    run_cfrun,
    slow_reference,
    tiny_reference,
)

from cfrun.codec.checkpoint import committed_steps, verify
from cfrun.contract import faults
from cfrun.contract.jobdir import step_dir_name
from cfrun.peer.protocol import (
    FRAME,
    FRAME_MAGIC,
    SEQ,
    Channel,
    Op,
    PeerAuthError,
    PeerClient,
    client_handshake,
    manifest_key,
    seal_tag,
)
from cfrun.storage.tiers import open_storage

pytestmark = pytest.mark.timeout(300)
K = 10
TINY = [str(SCRIPTS / "train_tiny.py"), "--epochs", "4"]
SLOW = str(SCRIPTS / "slow_steps.py")


def write_token(path: Path, token: str | None = None) -> Path:
    path.write_text((token or secrets.token_hex(32)) + "\n")
    path.chmod(0o600)
    return path


class Peer:
    """A `cfrun peer` subprocess; its stderr lines are collected by a thread."""

    def __init__(self, cwd: Path, flush_to: str, token_file: Path, *, port: int = 0,
                 env: dict[str, str] | None = None, extra: list[str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cfrun", "peer", "--listen", f"127.0.0.1:{port}",
             "--flush-to", flush_to, "--token-file", str(token_file), *(extra or [])],
            cwd=cwd, env=clean_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        threading.Thread(target=self._read, daemon=True).start()
        m = self.wait_for(r"listening on 127\.0\.0\.1:(\d+)")
        self.port = int(m.group(1))
        self.address = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not any(re.search(pattern, l)
                                                        for l in self.lines):
                time.sleep(0.2)
                raise AssertionError(f"peer exited ({self.proc.returncode}): {self.lines}")
            time.sleep(0.05)
        raise AssertionError(f"peer never logged {pattern!r}: {self.lines[-20:]}")

    def log(self) -> str:
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def peers():
    started: list[Peer] = []

    def start(*args, **kwargs) -> Peer:
        p = Peer(*args, **kwargs)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``--interval K`` with TINY, uninterrupted (shared with other modules)."""
    return tiny_reference(tmp_path_factory)


def wait_event(job_dir: Path, kind: str, pred=lambda e: True, timeout_s: float = 60.0,
               proc: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = job_dir / "events.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if e.get("event") == kind and pred(e):
                    return e
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"cfrun exited ({proc.returncode}) before a {kind} event: "
                                 f"{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event in {job_dir}")


# ---------------------------------------------------------------------- protected and durable


@pytest.mark.slow
def test_checkpoints_are_protected_in_peer_ram_then_durable_in_the_flush_dir(tmp_path, peers,
                                                                              reference):
    ref_run, ref_state = reference
    token = write_token(tmp_path / "token")
    peer = peers(tmp_path, str(tmp_path / "l2"), token)
    run = run_cfrun(["--interval", str(K), "--job-dir", "j", "--job-name", "j", "--peer",
                     peer.address, "--peer-token-file", str(token), "--peer-streams", "3", *TINY,
                     "--out", "got.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoints = run.events("checkpoint")
    assert checkpoints and all(e["tier"] == "peer" for e in checkpoints)
    protected = {e["step"]: e for e in run.events("protected")}
    durable = {e["step"]: e for e in run.events("durable")}
    assert {e["step"] for e in checkpoints} | run.final_steps() == set(protected) == set(durable)
    for step, e in protected.items():  # PGT ends at "protected", before "durable"
        assert e["pgt_s"] > 0 and durable[step]["durable_s"] >= e["pgt_s"]
        assert durable[step]["url"] == str(tmp_path / "l2")
    assert committed_steps(run.job_dir / "checkpoints") == []  # peer RAM replaced the disk
    for step in protected:
        assert re.search(rf"protected j step {step}: \d+ bytes from 1 ranks", peer.log())
        assert re.search(rf"durable j step {step}: \d+ bytes flushed", peer.log())
    flushed = committed_steps(tmp_path / "l2" / "j")  # the job dir's format, manifest last
    assert flushed == sorted(protected, reverse=True)[:3]  # peer --keep 3
    for step in flushed:
        verify(tmp_path / "l2" / "j" / step_dir_name(step))
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(run.stdout) == final_line(ref_run.stdout)


def test_resume_from_peer_ram_after_every_rank_was_killed_and_the_disk_lost(tmp_path, peers,
                                                                             tmp_path_factory):
    """2 ranks in parallel to the peer; every rank killed, the job dir's checkpoints and the
    flush dir deleted (a lost spot VM, level 2 not reached yet): the resume installs the newest
    checkpoint from peer RAM and ends bit-identical to an uninterrupted run."""
    script = str(SCRIPTS / "train_ddp.py")
    common = ["--nproc-per-node", "2", "--interval", str(K)]
    ref, ref_state = ddp_reference(tmp_path_factory)  # shared with other modules
    token = write_token(tmp_path / "token")
    peer = peers(tmp_path, str(tmp_path / "l2"), token, extra=["--slots", "3"])
    first = run_cfrun([*common, "--job-dir", "j", "--job-name", "j", "--max-restarts", "0",
                       "--inject-crash", "55",
                       "--peer", peer.address, "--peer-token-file", str(token), script,
                       "got.pt"], cwd=tmp_path)
    assert first.returncode == 4, first.stderr[-3000:]
    newest = max(e["step"] for e in first.events("protected"))
    assert re.search(rf"protected j step {newest}: \d+ bytes from 2 ranks", peer.log())
    shutil.rmtree(tmp_path / "j" / "checkpoints")
    shutil.rmtree(tmp_path / "l2")
    run = run_cfrun(["resume", "j"], cwd=tmp_path)
    run.job_dir = tmp_path / "j"
    assert run.returncode == 0, run.stderr[-3000:]
    [fetched] = run.events("fetched")
    assert (fetched["source"], fetched["step"]) == ("peer", newest)
    assert {e["step"] for e in run.events("resumed")} == {newest}
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert [l for l in run.stdout.splitlines() if l.startswith("epoch 2")] == \
        [l for l in ref.stdout.splitlines() if l.startswith("epoch 2")]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a cfrun and every process under it (agent, launcher, ranks), as a lost VM."""
    root = psutil.Process(proc.pid)
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(procs, timeout=10)


def test_a_new_machine_resumes_from_peer_ram_with_nothing_but_the_token(tmp_path, peers,
                                                                        tmp_path_factory):
    """Issue 32: the node lost as a new VM loses it: every process of the job SIGKILLed, the
    job dir removed whole (job.key included), then the same command line on a fresh empty job
    dir with only the token file. The job's seal key derives from the token and the job's
    name (the job dir's path, not its contents), so the resume installs the newest checkpoint
    from peer RAM, redoes at most interval + 1 iterations, and ends bit-identical to an
    uninterrupted run; with the peer gone too, the same command resumes from level 2.
    (Before: every checkpoint at the peer was refused as "not sealed by this job", and the job
    started over.)"""
    _, ref_state = slow_reference(tmp_path_factory)  # the same 60 steps, uninterrupted
    token = write_token(tmp_path / "token")
    peer = peers(tmp_path, str(tmp_path / "l2"), token, extra=["--slots", "4"])
    argv = [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j", "--peer",
            peer.address, "--peer-token-file", str(token), "--persist-to", str(tmp_path / "l2"),
            "--launcher", "python", SLOW, "60", "out.pt", "0.1"]
    job = tmp_path / "j"
    with open(tmp_path / "first.out", "w") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stdout=out,
                                stderr=subprocess.DEVNULL)
        try:
            protected = wait_event(job, "protected", lambda e: e["step"] >= 20, timeout_s=120,
                                   proc=proc)["step"]
        finally:
            _kill_tree(proc)
    done = [int(l.split()[1]) for l in (tmp_path / "first.out").read_text().splitlines()
            if re.fullmatch(r"step \d+", l)]
    assert done and max(done) >= protected and max(done) < 60
    lost_key = (job / "job.key").read_bytes()  # the job dir's own (its manifests' MACs)
    shutil.rmtree(job)  # the job dir whole, job.key with it: a new VM has none
    assert not job.exists()
    run = run_cfrun(argv[3:], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    fetched = run.events("fetched")
    assert fetched and fetched[0]["source"] == "peer", (fetched, run.stderr[-3000:])
    step = fetched[0]["step"]
    assert step >= protected
    assert not run.events("fetch_failed"), run.events("fetch_failed")
    assert [e["step"] for e in run.events("resumed")] == [step]
    assert max(done) - step <= 5 + 1  # at most interval + 1 iterations redone
    again = [int(l.split()[1]) for l in run.stdout.splitlines() if re.fullmatch(r"step \d+", l)]
    assert again[0] == step + 1 and again[-1] == 60
    # nothing the user must carry but the token: the new job dir made a job.key of its own
    assert (job / "job.key").read_bytes() != lost_key
    assert_bit_identical(ref_state, torch.load(tmp_path / "out.pt", weights_only=True))
    # the peer gone too (it flushed what it held): the same command on a fresh job dir finds
    # the job's checkpoints at level 2, sealed under the token's key
    peer.stop()
    shutil.rmtree(job)
    (tmp_path / "out.pt").unlink()
    third = run_cfrun(argv[3:], cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    fetched = third.events("fetched")
    assert fetched and {e["source"] for e in fetched} == {"level2"}, third.stderr[-3000:]
    assert not third.events("fetch_failed"), third.events("fetch_failed")
    assert [e["step"] for e in third.events("resumed")] == [fetched[-1]["step"]]
    assert_bit_identical(ref_state, torch.load(tmp_path / "out.pt", weights_only=True))


@pytest.mark.slow
def test_agent_killed_mid_transfer_leaves_a_partial_checkpoint_that_is_never_used(
        tmp_path, peers, reference):
    ref_run, ref_state = reference
    token = write_token(tmp_path / "token")
    peer = peers(tmp_path, str(tmp_path / "l2"), token, extra=["--slots", "3"])
    run = run_cfrun(["--interval", str(K), "--keep", "100", "--job-dir", "j", "--job-name", "j",
                     "--peer", peer.address, "--peer-token-file", str(token), *TINY, "--out",
                     "got.pt"],
                    cwd=tmp_path, env=faults.arm({}, **{"agent.kill_at_step": 20}))
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("agent_restart")) == 1
    [lost] = [e["step"] for e in run.events("persist_lost")]
    assert lost >= 20 and lost not in {e["step"] for e in run.events("protected")}
    assert f"receiving j step {lost}" in peer.log()
    assert not re.search(rf"protected j step {lost}:", peer.log())
    assert lost not in committed_steps(tmp_path / "l2" / "j")
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))


# ---------------------------------------------------------------------- failures


@pytest.mark.slow
def test_peer_killed_mid_flush_training_continues_locally_then_reconnects(tmp_path, peers):
    token = write_token(tmp_path / "token")
    l2_url = f"file://{tmp_path / 'l2'}"
    slow = peers(tmp_path, l2_url, token, env=faults.arm({}, **{"peer.flush_delay_s": 60}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j", "--job-name", "j",
         "--peer", slow.address, "--peer-token-file", str(token), SLOW, "5000", "out.pt", "0.04"],
        cwd=tmp_path, env=clean_env({"SLOW_STEPS_STOP_FILE": str(tmp_path / "stop")}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        job = tmp_path / "j"
        flushing = int(slow.wait_for(r"flushing j step (\d+)").group(1))
        slow.kill()  # SIGKILL half-way through a flush
        storage = open_storage(l2_url)
        assert (tmp_path / "l2" / "j" / step_dir_name(flushing) / "rank-00000.bin").exists()
        assert flushing not in storage.list_steps("j")  # files without a manifest never count
        down = wait_event(job, "peer_unavailable", proc=proc)
        wait_event(job, "commit", lambda e: e["t_unix_s"] > down["t_unix_s"], proc=proc)
        again = peers(tmp_path, l2_url, token, port=slow.port)  # restarted, same address
        assert again.port == slow.port
        up = wait_event(job, "peer_reconnected", proc=proc)
        wait_event(job, "durable", lambda e: e["t_unix_s"] > up["t_unix_s"], proc=proc)
        (tmp_path / "stop").touch()  # the script ends at its next step (5000 would be 200 s)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = Run(proc.returncode, out, err, tmp_path / "j")
    assert run.returncode == 0, err[-3000:]
    assert "unavailable" in err and len(run.events("peer_unavailable")) == 1  # warned once
    tiers = [e["tier"] for e in run.events("checkpoint")]
    assert tiers[0] == "peer" and "local" in tiers and tiers[-1] == "peer"
    assert len(run.events("attempt_start")) == 1  # the ranks never noticed
    assert flushing not in storage.list_steps("j")  # cleaned up or still without a manifest
    assert not (tmp_path / "l2" / "j" / step_dir_name(flushing)).exists()  # restart cleaned it
    for step in storage.list_steps("j"):
        manifest = storage.read_manifest("j", step)
        for f in manifest["files"]:
            data = storage.read_file("j", step, f["name"], f["nbytes"])
            assert xxhash.xxh3_64_hexdigest(data) == f["xxh3_64"]


def test_wrong_token_is_refused_logged_and_training_falls_back(tmp_path, peers):
    peer = peers(tmp_path, str(tmp_path / "l2"), write_token(tmp_path / "token"))
    wrong = write_token(tmp_path / "wrong")
    run = run_cfrun(["--interval", "5", "--job-dir", "j", "--peer", peer.address,
                     "--peer-token-file", str(wrong), SLOW, "30", "out.pt", "0.01"],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    [down] = run.events("peer_unavailable")
    assert "token" in down["error"]
    assert "authentication failed (wrong token)" in peer.log()
    assert {e["tier"] for e in run.events("checkpoint")} == {"local"}
    assert committed_steps(run.job_dir / "checkpoints")
    assert not (tmp_path / "l2").exists() or not any((tmp_path / "l2").iterdir())
    with pytest.raises(PeerAuthError):
        PeerClient(("127.0.0.1", peer.port), wrong.read_text().strip().encode())


# ---------------------------------------------------------------------- fuzzing


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _authed(port: int, token: bytes) -> Channel:
    """A raw connection past the handshake: frames are built by hand and tagged right."""
    s = _raw(port)
    return client_handshake(s, token, f"127.0.0.1:{port}")


def _rejections(log: str) -> int:
    """Connections the peer's gate rejected, from its log: one line each, plus the counts of
    its periodic summary of evicted and expired handshakes."""
    single = len(re.findall(r"rejected \S+: ", log))
    summed = sum(int(n) for n in re.findall(r"rejected (\d+) unauthenticated connections", log))
    return single + summed


def _send_quietly(s: socket.socket | Channel, data: bytes) -> None:
    s = s.sock if isinstance(s, Channel) else s
    try:
        s.sendall(data)
        s.settimeout(2)
        s.recv(1 << 16)
    except OSError:
        pass
    finally:
        s.close()


def _frame(ch: Channel | None, op: int, header: dict | bytes, payload_len: int = 0, *,
           json_len: int | None = None, magic: bytes = FRAME_MAGIC) -> bytes:
    """A frame header + JSON as given, with the tag the channel's key gives it (a valid tag on
    whatever the bytes say: what an authenticated but hostile or buggy client can send)."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    fixed = FRAME.pack(magic, 2, op, 0, len(body) if json_len is None else json_len,
                       payload_len)
    if ch is None:
        return fixed + body
    tag = hmac.new(ch.send_key, SEQ.pack(ch.send_seq) + fixed + body, "sha256").digest()
    ch.send_seq += 1
    return fixed + body + tag


def _seal_args(token: bytes, job: str, step: int, files: list[dict], meta: dict) -> dict:
    return {"job": job, "step": step, "world_size": 1, "rank": 0, "files": files, "meta": meta,
            "tag": seal_tag(manifest_key(token, job), step=step, world_size=1, rank=0,
                            files=files, meta=meta)}


def test_fuzzed_frames_never_crash_the_peer_nor_grow_its_memory(tmp_path, peers):
    token_file = write_token(tmp_path / "token")
    token = token_file.read_text().strip().encode()
    peer = peers(tmp_path, str(tmp_path / "l2"), token_file,
                 extra=["--slots", "2", "--max-checkpoint-bytes", "8M"])
    port = peer.port
    rng = __import__("random").Random(7)

    def roundtrip(step: int) -> None:
        c = PeerClient(("127.0.0.1", port), token)
        data = bytes(rng.getrandbits(8) for _ in range(1000)) * 1000
        c.put(job="ok", step=step, world_size=1, name="rank-00000.bin", part=0, nparts=1,
              offset=0, file_bytes=len(data), data=data)
        c.put(job="ok", step=step, world_size=1, name="rank-00000.json", part=0, nparts=1,
              offset=0, file_bytes=2, data=b"{}")
        files = [{"name": "rank-00000.bin", "nbytes": len(data),
                  "xxh3_64": xxhash.xxh3_64_hexdigest(data)},
                 {"name": "rank-00000.json", "nbytes": 2,
                  "xxh3_64": xxhash.xxh3_64_hexdigest(b"{}")}]
        assert c.seal(**_seal_args(token, "ok", step, files, {}))
        assert c.await_state("ok", step, "durable", 30)["state"] == "durable"
        assert bytes(c.get("ok", step, "rank-00000.bin", 1 << 24)) == data
        c.close()

    roundtrip(1)
    rss0 = psutil.Process(peer.proc.pid).memory_info().rss
    for _ in range(150):  # random bytes before any handshake
        _send_quietly(_raw(port), rng.randbytes(rng.randint(0, 3000)))
    for n in (0, 3, 10, 68, 69):  # truncated or bogus handshakes
        _send_quietly(_raw(port), (b"CFPC\x02" + rng.randbytes(64))[:n])
    header = {"job": "fz", "step": 1, "world_size": 1, "name": "rank-00000.bin", "part": 0,
              "nparts": 1, "offset": 0, "file_bytes": 4 << 20, "xxh3_64": "0"}
    evil = [
        lambda ch: rng.randbytes(500),                               # garbage after auth
        lambda ch: _frame(ch, Op.LIST, {"job": "ok"})[:7],           # truncated header
        lambda ch: _frame(ch, Op.LIST, {"job": "ok"}, json_len=2 ** 32 - 1),  # huge JSON length
        lambda ch: _frame(ch, Op.PUT, header, payload_len=2 ** 63),  # huge payload length
        lambda ch: _frame(ch, Op.PUT, {**header, "file_bytes": 2 ** 40}, payload_len=2 ** 30),
        lambda ch: _frame(ch, Op.PUT, header, magic=b"XXXX"),        # bad magic
        lambda ch: _frame(ch, Op.LIST, b"[1, 2, 3]"),                # JSON not an object
        lambda ch: _frame(ch, Op.LIST, b"[" * 60000),                # deeply nested JSON
        lambda ch: _frame(ch, Op.LIST, b"\xff\xfe not json"),
        lambda ch: _frame(ch, 99, {"job": "ok"}),                    # unknown op
        lambda ch: _frame(ch, Op.LIST, {"job": "../../etc"}),        # path traversal
        lambda ch: _frame(ch, Op.GET, {"job": "ok", "step": 1, "max_bytes": 10,
                                       "name": "../../../etc/passwd"}),
        lambda ch: _frame(ch, Op.SEAL, {"job": "ok", "step": 1, "world_size": 1, "rank": 0,
                                        "files": "x"}),
        lambda ch: _frame(ch, Op.LIST, {"job": "ok"}, payload_len=100) + rng.randbytes(100),
        lambda ch: _frame(ch, Op.PUT, {**header, "name": "../x.bin"}, payload_len=10) + b"0" * 10,
        lambda ch: _frame(ch, Op.PUT, {**header, "wait_s": float("nan")}, payload_len=10),
        lambda ch: _frame(ch, Op.AWAIT, b'{"job":"ok","step":1,"timeout_s":1e999}'),
        lambda ch: _frame(None, Op.LIST, {"job": "ok"}) + bytes(32),  # no valid tag
    ]
    for make in evil:
        ch = _authed(port, token)
        _send_quietly(ch, make(ch))
    cpu0 = sum(psutil.Process(peer.proc.pid).cpu_times()[:2])
    time.sleep(1.0)
    assert sum(psutil.Process(peer.proc.pid).cpu_times()[:2]) - cpu0 < 0.3  # NaN: no spinning
    # reserve 4 MB, send 1 MB, vanish (a sender dying mid-transfer), several times
    for i in range(6):
        ch = _authed(port, token)
        ch.send_header(Op.PUT, {**header, "step": i}, 4 << 20)
        assert ch.recv_header(0)[1]["go"]
        ch.sock.sendall(rng.randbytes(1 << 20))
        ch.sock.close()
    # over budget: 7 MB + 2 MB in one 8 MB checkpoint -> refused before allocation
    ch = _authed(port, token)
    ch.send_header(Op.PUT, {**header, "step": 50, "file_bytes": 7 << 20}, 7 << 20)
    assert ch.recv_header(0)[1]["go"]
    ch.send_payload([b"\0" * (7 << 20)])
    assert ch.recv_header(0)[1]["ok"] is False  # checksum "0" is wrong
    ch.send_header(Op.PUT, {**header, "step": 50, "file_bytes": 7 << 20,
                            "xxh3_64": xxhash.xxh3_64_hexdigest(b"\0" * (7 << 20))}, 7 << 20)
    assert ch.recv_header(0)[1]["go"]
    ch.send_payload([b"\0" * (7 << 20)])
    assert ch.recv_header(0)[1]["ok"] is True
    ch.send_header(Op.PUT, {**header, "step": 50, "name": "rank-00000.json",
                            "file_bytes": 2 << 20}, 2 << 20)
    reply = ch.recv_header(0)[1]
    assert reply["ok"] is False and "max-checkpoint-bytes" in reply["error"]
    ch.drop_payload()
    ch.send_header(Op.PUT, {**header, "step": 51, "file_bytes": 9 << 20},
                   9 << 20)  # over the maximum: the connection is closed
    try:
        assert ch.sock.recv(1 << 16) == b""
    except ConnectionResetError:
        pass
    ch.sock.close()
    # a flood of idle connections, then all closed
    idle = [_raw(port) for _ in range(40)]
    for s in idle:
        s.close()
    time.sleep(1.0)
    assert peer.proc.poll() is None, peer.log()
    roundtrip(2)
    roundtrip(3)
    rss1 = psutil.Process(peer.proc.pid).memory_info().rss
    assert rss1 - rss0 < 40 << 20, (rss0, rss1)  # budget: 2 slots x 8 MB
    # every one of the 155 garbage connections is rejected: a line each, or counted in the gate's
    # summary line (evicted or expired while the loaded peer lagged; one every 10 s)
    deadline = time.monotonic() + 15
    while _rejections(peer.log()) < 150 and time.monotonic() < deadline:
        time.sleep(0.2)
    log = peer.log()
    assert _rejections(log) >= 150, log[-3000:]
    assert "authentication failed" in log and "exceeds" in log
    assert "non-finite number" in log and "frame failed authentication" in log
    c = PeerClient(("127.0.0.1", port), token)
    states = {e["step"]: e["state"] for e in c.list("fz")["checkpoints"]}
    assert all(s == "filling" for s in states.values())  # partial data is never complete
    with pytest.raises(ConnectionError):
        c.get("fz", 50, "rank-00000.bin", 1 << 24)


# ---------------------------------------------------------------------- S3 (moto)


@pytest.fixture
def s3_endpoint():
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        pytest.skip(f"moto/boto3 not installed: {e}")
    try:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    except Exception as e:  # pragma: no cover - environment dependent
        pytest.skip(f"moto server cannot start: {e!r}")
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "CFRUN_S3_ENDPOINT_URL": url}
    boto3.client("s3", endpoint_url=url, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1"
                 ).create_bucket(Bucket="ckpt")
    yield env
    server.stop()


@pytest.mark.slow
def test_flush_to_s3_then_resume_from_s3_with_the_peer_gone(tmp_path, peers, reference,
                                                            s3_endpoint, monkeypatch):
    ref_run, ref_state = reference
    token = write_token(tmp_path / "token")
    url = "s3://ckpt/runs"
    peer = peers(tmp_path, url, token, env=s3_endpoint)
    args = ["--interval", str(K), "--job-dir", "j", "--job-name", "j", "--peer", peer.address,
            "--peer-token-file", str(token), "--persist-to", url]
    first = run_cfrun([*args, "--max-restarts", "0", "--inject-crash", "35", *TINY,
                       "--out", "got.pt"], cwd=tmp_path, env=s3_endpoint)
    assert first.returncode == 4, first.stderr[-3000:]
    durable = [e["step"] for e in first.events("durable")]
    assert durable and all(e["url"] == url for e in first.events("durable"))
    peer.kill()  # its RAM is gone
    shutil.rmtree(tmp_path / "j" / "checkpoints")
    for k, v in s3_endpoint.items():
        monkeypatch.setenv(k, v)
    assert open_storage(url).list_steps("j")[0] == max(durable)
    run = run_cfrun(["resume", "j"], cwd=tmp_path, env=s3_endpoint)
    run.job_dir = tmp_path / "j"
    assert run.returncode == 0, run.stderr[-3000:]
    [fetched] = run.events("fetched")
    assert (fetched["source"], fetched["step"]) == ("level2", max(durable))
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(run.stdout) == final_line(ref_run.stdout)


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case,code,needle", [
    ("empty", 2, "holds no token"),
    ("world", 2, "chmod 600"),
    ("group", 2, "mode 0640: readable by other users; run `chmod 600"),
    ("link", 2, "is a symbolic link"),
    ("dir-link", 2, "tokens/b' is a symbolic link"),
    ("dir-mode", 2, "tokens/b' has mode 0644"),
    ("dir-name", 2, "'.b' cannot name a tenant"),
    ("dir-open", 2, "tokens' has mode 0755: other users could read or add tenants"),
    ("dir-slots", 2, "--slots 2 is fewer than the 3 tenants"),
    ("listen", 2, "is not HOST:PORT"),
    ("inuse", 69, "cannot listen on"),
])
def test_peer_bad_input_is_one_line_with_a_distinct_exit_code(tmp_path, case, code, needle):
    token = write_token(tmp_path / "token")
    listen = "127.0.0.1:0"
    blocker = None
    if case == "empty":
        token.write_text("")
    elif case == "world":
        token.chmod(0o644)
    elif case == "group":
        token.chmod(0o640)
    elif case == "link":
        token = tmp_path / "link"
        token.symlink_to(tmp_path / "token")
    elif case.startswith("dir-"):  # a directory of token files, one per tenant
        tokens = tmp_path / "tokens"
        tokens.mkdir(mode=0o700)
        write_token(tokens / "a")
        if case == "dir-link":
            (tokens / "b").symlink_to(token)
        elif case == "dir-mode":
            write_token(tokens / "b").chmod(0o644)
        elif case == "dir-name":
            write_token(tokens / ".b")
        elif case == "dir-open":
            tokens.chmod(0o755)
        elif case == "dir-slots":
            write_token(tokens / "b")
            write_token(tokens / "c")
        token = tokens
    elif case == "listen":
        listen = "localhost"
    elif case == "inuse":
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        listen = f"127.0.0.1:{blocker.getsockname()[1]}"
    run = run_cfrun(["peer", "--listen", listen, "--flush-to", str(tmp_path / "l2"),
                     "--token-file", str(token)], cwd=tmp_path, timeout=300)
    if blocker is not None:
        blocker.close()
    assert run.returncode == code, run.stderr
    assert needle in run.stderr and run.stderr.startswith("cfrun: error:")
    assert len(run.stderr.strip().splitlines()) <= 2  # the error and a hint


def test_run_with_peer_but_no_token_file_or_a_bad_job_name_is_refused(tmp_path):
    run = run_cfrun(["--peer", "127.0.0.1:7077", SLOW, "3", "out.pt", "0"], cwd=tmp_path,
                    timeout=300)
    assert run.returncode == 2 and "--peer-token-file" in run.stderr
    token = write_token(tmp_path / "token")
    run = run_cfrun(["--peer", "127.0.0.1:7077", "--peer-token-file", str(token), "--job-dir",
                     "my job", "--job-name", "my job", SLOW, "3", "out.pt", "0"], cwd=tmp_path,
                    timeout=300)
    assert run.returncode == 2 and "--job-name 'my job'" in run.stderr, run.stderr
    assert not (tmp_path / "cfrun-jobs").exists() and not (tmp_path / "my job").exists()


# ---------------------------------------------------------------------- attacks


SLOW_FLOOD = r"""
import selectors, socket, sys, time
port, n, duration_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
prefix = b"CFPC\x02" + bytes(64)  # a plausible hello, one byte a second: never finished
sel = selectors.DefaultSelector()
state = {}  # socket -> [bytes sent, next send time]
opened = 0

def connect(t):
    global opened
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
    state[s] = [0, t]
    opened += 1

t0 = time.monotonic()
for i in range(n):
    connect(t0 + i / n)
print("flooding", flush=True)
end = t0 + duration_s
while time.monotonic() < end:
    for key, _ in sel.select(0.05):
        try:
            key.fileobj.recv(4096)  # the server's hello; EOF is noticed at the next send
        except OSError:
            pass
    now = time.monotonic()
    for s, st in list(state.items()):
        if st[1] > now:
            continue
        try:
            s.send(prefix[st[0] % len(prefix):][:1])
            st[0] += 1
            st[1] = now + 1.0
        except OSError:  # evicted or timed out: come back with a fresh connection
            sel.unregister(s)
            del state[s]
            s.close()
            connect(now + 1.0)
print("opened", opened, flush=True)
"""


@pytest.mark.timing
def test_a_flood_of_slow_unauthenticated_connections_does_not_lock_out_a_valid_client(
        tmp_path, peers):
    """300 connections from one address, each sending one byte of a hello a second and coming
    back when closed (a slowloris): a valid client still completes a transfer within 2 s."""
    token_file = write_token(tmp_path / "token")
    token = token_file.read_text().strip().encode()
    peer = peers(tmp_path, str(tmp_path / "l2"), token_file,
                 extra=["--slots", "4", "--max-checkpoint-bytes", "8M"])
    flood = subprocess.Popen([sys.executable, "-c", SLOW_FLOOD, str(peer.port), "300", "25"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
        time.sleep(2.0)  # every slot mid-handshake is taken, the flood churns
        data = secrets.token_bytes(1 << 20)
        worst_s = 0.0
        for step in range(1, 6):
            t0 = time.monotonic()
            c = PeerClient(("127.0.0.1", peer.port), token, io_timeout_s=5)
            _put_and_seal(c, token, "v", step, data)
            assert bytes(c.get("v", step, "rank-00000.bin", len(data), exact=True)) == data
            c.close()
            worst_s = max(worst_s, time.monotonic() - t0)
            time.sleep(0.3)
        assert worst_s < 2.0, worst_s
        assert flood.poll() is None  # the flood was on all along
    finally:
        flood.kill()
        out = flood.communicate()[0]
    assert peer.proc.poll() is None
    peer.wait_for(r"rejected \d+ unauthenticated connections in the last 10 s \(\d+ evicted: "
                  r"at most 16 mid-handshake, 8 per address", timeout_s=15)
    print(f"worst transfer {worst_s:.3f} s under the flood {out.strip()}")


def _put_and_seal(c: PeerClient, token: bytes, job: str, step: int, data: bytes) -> bool:
    c.put(job=job, step=step, world_size=1, name="rank-00000.bin", part=0, nparts=1, offset=0,
          file_bytes=len(data), data=data)
    c.put(job=job, step=step, world_size=1, name="rank-00000.json", part=0, nparts=1, offset=0,
          file_bytes=2, data=b"{}")
    files = [{"name": "rank-00000.bin", "nbytes": len(data),
              "xxh3_64": xxhash.xxh3_64_hexdigest(data)},
             {"name": "rank-00000.json", "nbytes": 2, "xxh3_64": xxhash.xxh3_64_hexdigest(b"{}")}]
    return c.seal(**_seal_args(token, job, step, files, {"step": step}))


class Relay:
    """A TCP relay on 127.0.0.1 in front of the peer: the attacker on the path, without the token.

    ``mode`` ``forward`` relays faithfully; ``answer`` forwards the handshake, then answers every
    request itself: LIST with a forged step, GET with a forged manifest whose checksums match its
    forged bytes. It cannot compute the frames' tags, so it sends random ones.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.mode = "forward"
        self.answered = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                return
            if self.mode == "answer":
                threading.Thread(target=self._answer, args=(client, server), daemon=True).start()
            else:
                for src, dst in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _answer(self, client: socket.socket, server: socket.socket) -> None:
        forged = b"\0" * 64
        manifest = json.dumps({
            "format_version": 1, "step": 99999999, "world_size": 1, "meta": {"step": 99999999},
            "files": [{"name": "rank-00000.bin", "nbytes": 64,
                       "xxh3_64": xxhash.xxh3_64_hexdigest(forged)}],
            "seals": [{"rank": 0, "tag": "0" * 64}]}).encode()
        try:
            client.settimeout(30)
            client.sendall(server.recv(37, socket.MSG_WAITALL))  # the peer's hello
            server.sendall(client.recv(69, socket.MSG_WAITALL))  # the agent's proof
            client.sendall(server.recv(36, socket.MSG_WAITALL))  # the peer's proof
            server.close()
            while True:
                fixed = client.recv(FRAME.size, socket.MSG_WAITALL)
                if len(fixed) < FRAME.size:
                    return
                _, _, op, _, json_len, _ = FRAME.unpack(fixed)
                request = json.loads(client.recv(json_len + 32, socket.MSG_WAITALL)[:json_len])
                payload = b""
                if op == Op.GET:
                    payload = manifest if request.get("name") == "manifest.json" else forged
                body = json.dumps({"ok": True, "go": False, "complete": True, "flush_to": "x",
                                   "nbytes": len(payload), "checkpoints": [
                                       {"step": 99999999, "world_size": 1, "state": "durable",
                                        "bytes": 64}]}).encode()
                self.answered += 1
                client.sendall(FRAME.pack(FRAME_MAGIC, 2, op | 0x80, 0, len(body), len(payload))
                               + body + secrets.token_bytes(32) + payload
                               + (secrets.token_bytes(32) if payload else b""))
        except OSError:
            pass
        finally:
            client.close()


@pytest.mark.slow
def test_a_relay_that_answers_after_the_handshake_installs_nothing(tmp_path, peers, reference):
    """The agent reaches the peer through a relay. After a crash and the loss of the disk, the
    relay forwards the resume's handshake, then answers LIST/GET itself with a forged newer
    checkpoint: the agent refuses its first frame, says so in one line, installs nothing, and
    the job trains from scratch to the reference result."""
    _, ref_state = reference
    token = write_token(tmp_path / "token")
    peer = peers(tmp_path, str(tmp_path / "l2"), token)
    relay = Relay(("127.0.0.1", peer.port))
    try:
        first = run_cfrun(["--interval", str(K), "--job-dir", "j", "--max-restarts", "0",
                           "--inject-crash", "35", "--peer", relay.address, "--peer-token-file",
                           str(token), *TINY, "--out", "got.pt"], cwd=tmp_path)
        assert first.returncode == 4, first.stderr[-3000:]
        assert first.events("protected")  # through the faithful relay
        shutil.rmtree(tmp_path / "j" / "checkpoints")
        relay.mode = "answer"
        run = run_cfrun(["resume", "j"], cwd=tmp_path)
        run.job_dir = tmp_path / "j"
    finally:
        relay.close()
    assert run.returncode == 0, run.stderr[-3000:]
    assert relay.answered >= 1
    assert not run.events("fetched") and not run.events("resumed")
    said = [l for l in run.stderr.splitlines() if "failed authentication" in l]
    assert len(said) == 1 and "relay" in said[0], run.stderr[-3000:]
    assert [e["step"] for e in run.events("checkpoint")] and \
        max(e["step"] for e in run.events("checkpoint")) < 99999999
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))



# ---------------------------------------------------------------------- tenants, flush queues


def test_another_tenant_can_neither_see_forge_nor_crowd_out_a_job_that_lost_its_node(
        tmp_path, peers, tmp_path_factory):
    """Issue 32: a peer serves two tenants, each with its own token file in one directory.
    Tenant a's job checkpoints there, then loses its node (every process SIGKILLed, the job dir
    removed). Tenant b, knowing the job's name, cannot LIST, GET or AWAIT its checkpoints; a
    complete, sealed step 999 that b sends under the same name (with the job's id) lands in
    b's own namespace and level-2 directory; b filling every slot it can neither evicts a's
    checkpoints nor refuses a's new ones. The same command on a fresh job dir resumes from a's
    own newest checkpoint in peer RAM, bit-identical to the uninterrupted run."""
    from cfrun.agent.peertier import PeerTier
    from cfrun.contract.config import job_id_of
    from cfrun.peer.protocol import PeerError

    _, ref_state = slow_reference(tmp_path_factory)
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    token_a, token_b = write_token(tokens / "a"), write_token(tokens / "b")
    a_key, b_key = (t.read_text().strip().encode() for t in (token_a, token_b))
    l2 = tmp_path / "l2"
    peer = peers(tmp_path, str(l2), tokens, extra=["--slots", "4"])
    assert re.search(r"tenants a \(2\), b \(2\)", peer.log())
    argv = [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j", "--job-name",
            "j", "--peer", peer.address, "--peer-token-file", str(token_a), "--persist-to",
            str(l2 / "_tenants" / "a"), "--launcher", "python", SLOW, "60", "out.pt", "0.1"]
    job = tmp_path / "j"
    with open(tmp_path / "first.out", "w") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=clean_env(), stdout=out,
                                stderr=subprocess.DEVNULL)
        try:
            protected = wait_event(job, "protected", lambda e: e["step"] >= 20, timeout_s=120,
                                   proc=proc)["step"]
        finally:
            _kill_tree(proc)
    shutil.rmtree(job)
    address = ("127.0.0.1", peer.port)
    a = PeerClient(address, a_key)
    mine = [c["step"] for c in a.list("j")["checkpoints"] if c["state"] != "filling"]
    assert mine and max(mine) >= protected
    b = PeerClient(address, b_key)
    assert b.list("j")["checkpoints"] == []
    for step in mine:
        with pytest.raises(PeerError, match="not complete in peer RAM"):
            b.get("j", step, "manifest.json", 1 << 20)
        assert b.await_state("j", step, "durable", 0)["state"] == "missing"
    slot = tmp_path / "forged.bin"
    slot.write_bytes(secrets.token_bytes(4096))
    forger = PeerTier(address, b_key, "j", streams=1, emit=lambda *a, **k: None)
    try:
        assert forger.send_shard(step=999, world_size=1, rank=0, slot=slot, nbytes=4096,
                                 doc=b'{"a": 1}', meta={"step": 999, "job_id": job_id_of("j")})
        assert forger.await_state(999, "durable", 30)["state"] == "durable"
    finally:
        forger.close()
    assert committed_steps(l2 / "_tenants" / "b" / "j") == [999]
    for partial in ("g1", "g2", "g3"):  # b holds every slot of its own with a partial step
        try:
            b.put(job=partial, step=1, world_size=1, name="rank-00000.bin", part=0, nparts=2,
                  offset=0, file_bytes=2, data=b"x", wait_s=0)
        except PeerError as e:
            assert partial == "g3" and "all 2 slots" in str(e)
        else:
            assert partial != "g3"
    assert [c["step"] for c in a.list("j")["checkpoints"] if c["state"] != "filling"] == mine
    run = run_cfrun(argv[3:], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    fetched = run.events("fetched")
    assert [(e["source"], e["step"]) for e in fetched] == [("peer", max(mine))], fetched
    assert [e["step"] for e in run.events("resumed")] == [max(mine)]
    assert {e["tier"] for e in run.events("checkpoint")} == {"peer"}  # never crowded out
    assert_bit_identical(ref_state, torch.load(tmp_path / "out.pt", weights_only=True))
    assert not (l2 / "j").exists()  # a's level 2 is its own: <flush>/_tenants/a/j
    assert 999 not in committed_steps(l2 / "_tenants" / "a" / "j")
    assert committed_steps(l2 / "_tenants" / "a" / "j")


def test_a_failing_flush_waits_behind_other_jobs_with_one_line_per_outage(tmp_path, peers):
    """Issue 32, finding 5: level 2 refuses one job's writes (a file where its directory
    goes). The other job's checkpoints still become durable, one after the other, while the
    failing one is retried with backoff; the peer says the outage once and the recovery once,
    and once the obstacle is gone the failing job's checkpoints are flushed in order."""
    token_file = write_token(tmp_path / "token")
    token = token_file.read_text().strip().encode()
    l2 = tmp_path / "l2"
    l2.mkdir()
    (l2 / "bad").write_text("not a directory")
    peer = peers(tmp_path, str(l2), token_file, extra=["--slots", "4"])
    c = PeerClient(("127.0.0.1", peer.port), token)
    data = secrets.token_bytes(1 << 16)
    assert _put_and_seal(c, token, "bad", 1, data)
    peer.wait_for(r"flush of bad step 1 failed: level 2: .*bad is not a directory")
    assert _put_and_seal(c, token, "bad", 2, data)
    t0 = time.monotonic()
    for step in range(1, 6):
        assert _put_and_seal(c, token, "good", step, data)
        assert c.await_state("good", step, "durable", 15)["state"] == "durable"
    assert time.monotonic() - t0 < 10  # not one backoff per checkpoint
    store = open_storage(str(l2))
    assert store.list_steps("good") == [5, 4, 3]  # --keep 3
    for step in (3, 4, 5):
        [f, _] = store.read_manifest("good", step)["files"]
        assert store.read_file("good", step, f["name"], f["nbytes"]) == data
    assert c.await_state("bad", 1, "durable", 0)["state"] == "protected"
    time.sleep(max(0.0, 2.5 - (time.monotonic() - t0)))  # a retry failed meanwhile
    (l2 / "bad").unlink()
    assert c.await_state("bad", 2, "durable", 30)["state"] == "durable"
    assert store.list_steps("bad") == [2, 1]
    log = peer.log()
    assert len(re.findall(r"flush of bad step \d+ failed", log)) == 1, log
    [again] = re.findall(r"flush of bad works again \(step 1 durable\) after (\d+) failed", log)
    assert 2 <= int(again) <= 3, log  # retried with backoff, not after every other flush
    assert "flush of good" not in log
