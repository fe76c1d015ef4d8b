"""The peer tier (ACUTE level 1 in a peer's RAM) with real processes on loopback.

A `cfrun peer` process, `cfrun --peer` training runs, real SIGKILLs, a real S3-compatible
server (moto) for level 2, and fuzzed frames from this process.
"""

from __future__ import annotations

import json
import os
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

from cfrun.codec.checkpoint import committed_steps, verify
from cfrun.contract.jobdir import step_dir_name
from cfrun.peer.server import FRAME, FRAME_MAGIC, Op, PeerAuthError, PeerClient, _mac
from cfrun.storage.tiers import open_storage
from conftest import SCRIPTS, Run, assert_bit_identical, clean_env, ddp_reference, final_line, \
    run_cfrun, tiny_reference

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


def test_checkpoints_are_protected_in_peer_ram_then_durable_in_the_flush_dir(tmp_path, peers,
                                                                              reference):
    ref_run, ref_state = reference
    token = write_token(tmp_path / "token")
    peer = peers(tmp_path, str(tmp_path / "l2"), token)
    run = run_cfrun(["--interval", str(K), "--job-dir", "j", "--peer", peer.address,
                     "--peer-token-file", str(token), "--peer-streams", "3", *TINY,
                     "--out", "got.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoints = run.events("checkpoint")
    assert checkpoints and all(e["tier"] == "peer" for e in checkpoints)
    protected = {e["step"]: e for e in run.events("protected")}
    durable = {e["step"]: e for e in run.events("durable")}
    assert {e["step"] for e in checkpoints} == set(protected) == set(durable)
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
    first = run_cfrun([*common, "--job-dir", "j", "--max-restarts", "0", "--inject-crash", "55",
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


def test_agent_killed_mid_transfer_leaves_a_partial_checkpoint_that_is_never_used(
        tmp_path, peers, reference):
    ref_run, ref_state = reference
    token = write_token(tmp_path / "token")
    peer = peers(tmp_path, str(tmp_path / "l2"), token, extra=["--slots", "3"])
    run = run_cfrun(["--interval", str(K), "--keep", "100", "--job-dir", "j", "--peer",
                     peer.address, "--peer-token-file", str(token), *TINY, "--out", "got.pt"],
                    cwd=tmp_path, env={"CFRUN_TEST_AGENT_KILL_AT": "20"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("agent_restart")) == 1
    [lost] = [e["step"] for e in run.events("persist_lost")]
    assert lost >= 20 and lost not in {e["step"] for e in run.events("protected")}
    assert f"receiving j step {lost}" in peer.log()
    assert not re.search(rf"protected j step {lost}:", peer.log())
    assert lost not in committed_steps(tmp_path / "l2" / "j")
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))


# ---------------------------------------------------------------------- failures


def test_peer_killed_mid_flush_training_continues_locally_then_reconnects(tmp_path, peers):
    token = write_token(tmp_path / "token")
    l2_url = f"file://{tmp_path / 'l2'}"
    slow = peers(tmp_path, l2_url, token, env={"CFRUN_TEST_PEER_FLUSH_SLOW_S": "60"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j", "--peer",
         slow.address, "--peer-token-file", str(token), SLOW, "240", "out.pt", "0.04"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
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
        out, err = proc.communicate(timeout=120)
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
            data = storage.read_file("j", step, f["name"])
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


def _authed(port: int, token: bytes) -> socket.socket:
    s = _raw(port)
    hello = s.recv(37, socket.MSG_WAITALL)
    nonce = secrets.token_bytes(32)
    s.sendall(b"CFPC\x01" + nonce + _mac(token, b"cfrun-peer/1 client", hello[5:], nonce))
    assert s.recv(36, socket.MSG_WAITALL)[:4] == b"CFPY"
    return s


def _send_quietly(s: socket.socket, data: bytes) -> None:
    try:
        s.sendall(data)
        s.settimeout(2)
        s.recv(1 << 16)
    except OSError:
        pass
    finally:
        s.close()


def _frame(op: int, header: dict | bytes, payload_len: int = 0, *, json_len: int | None = None,
           magic: bytes = FRAME_MAGIC) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return FRAME.pack(magic, 1, op, 0, len(body) if json_len is None else json_len,
                      payload_len) + body


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
        assert c.seal(job="ok", step=step, world_size=1, rank=0, files=files, meta={})
        assert c.await_state("ok", step, "durable", 30)["state"] == "durable"
        assert bytes(c.get("ok", step, "rank-00000.bin", 1 << 24)) == data
        c.close()

    roundtrip(1)
    rss0 = psutil.Process(peer.proc.pid).memory_info().rss
    for _ in range(150):  # random bytes before any handshake
        _send_quietly(_raw(port), rng.randbytes(rng.randint(0, 3000)))
    for n in (0, 3, 10, 68, 69):  # truncated or bogus handshakes
        _send_quietly(_raw(port), (b"CFPC\x01" + rng.randbytes(64))[:n])
    header = {"job": "fz", "step": 1, "world_size": 1, "name": "rank-00000.bin", "part": 0,
              "nparts": 1, "offset": 0, "file_bytes": 4 << 20, "xxh3_64": "0"}
    evil = [
        rng.randbytes(500),                                          # garbage after auth
        _frame(Op.LIST, {"job": "ok"})[:7],                          # truncated header
        _frame(Op.LIST, {"job": "ok"}, json_len=2 ** 32 - 1),         # huge JSON length
        _frame(Op.PUT, header, payload_len=2 ** 63),                 # huge payload length
        _frame(Op.PUT, {**header, "file_bytes": 2 ** 40}, payload_len=2 ** 30),
        _frame(Op.PUT, header, magic=b"XXXX"),                       # bad magic
        _frame(Op.LIST, b"[1, 2, 3]"),                               # JSON not an object
        _frame(Op.LIST, b"[" * 60000),                               # deeply nested JSON
        _frame(Op.LIST, b"\xff\xfe not json"),
        _frame(99, {"job": "ok"}),                                   # unknown op
        _frame(Op.LIST, {"job": "../../etc"}),                       # path traversal
        _frame(Op.GET, {"job": "ok", "step": 1, "name": "../../../etc/passwd"}),
        _frame(Op.SEAL, {"job": "ok", "step": 1, "world_size": 1, "rank": 0, "files": "x"}),
        _frame(Op.LIST, {"job": "ok"}, payload_len=100) + rng.randbytes(100),
        _frame(Op.PUT, {**header, "name": "../x.bin"}, payload_len=10) + b"0" * 10,
    ]
    for data in evil:
        _send_quietly(_authed(port, token), data)
    # reserve 4 MB, send 1 MB, vanish (a sender dying mid-transfer), several times
    for i in range(6):
        s = _authed(port, token)
        s.sendall(_frame(Op.PUT, {**header, "step": i}, payload_len=4 << 20))
        s.recv(1 << 16)
        s.sendall(rng.randbytes(1 << 20))
        s.close()
    # over budget: 7 MB + 2 MB in one 8 MB checkpoint -> refused before allocation
    s = _authed(port, token)
    s.sendall(_frame(Op.PUT, {**header, "step": 50, "file_bytes": 7 << 20},
                     payload_len=7 << 20))
    assert json.loads(s.recv(1 << 16)[FRAME.size:])["go"]
    s.sendall(b"\0" * (7 << 20))
    assert json.loads(s.recv(1 << 16)[FRAME.size:])["ok"] is False  # checksum "0" is wrong
    s.sendall(_frame(Op.PUT, {**header, "step": 50, "file_bytes": 7 << 20,
                              "xxh3_64": xxhash.xxh3_64_hexdigest(b"\0" * (7 << 20))},
                     payload_len=7 << 20))
    assert json.loads(s.recv(1 << 16)[FRAME.size:])["go"]
    s.sendall(b"\0" * (7 << 20))
    assert json.loads(s.recv(1 << 16)[FRAME.size:])["ok"] is True
    s.sendall(_frame(Op.PUT, {**header, "step": 50, "name": "rank-00000.json",
                              "file_bytes": 2 << 20}, payload_len=2 << 20))
    reply = json.loads(s.recv(1 << 16)[FRAME.size:])
    assert reply["ok"] is False and "max-checkpoint-bytes" in reply["error"]
    s.sendall(_frame(Op.PUT, {**header, "step": 51, "file_bytes": 9 << 20},
                     payload_len=9 << 20))  # over the maximum: the connection is closed
    try:
        assert s.recv(1 << 16) == b""
    except ConnectionResetError:
        pass
    s.close()
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
    log = peer.log()
    assert log.count("rejected") >= 150
    assert "authentication failed" in log and "exceeds" in log
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


def test_flush_to_s3_then_resume_from_s3_with_the_peer_gone(tmp_path, peers, reference,
                                                            s3_endpoint, monkeypatch):
    ref_run, ref_state = reference
    token = write_token(tmp_path / "token")
    url = "s3://ckpt/runs"
    peer = peers(tmp_path, url, token, env=s3_endpoint)
    args = ["--interval", str(K), "--job-dir", "j", "--peer", peer.address,
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
    elif case == "listen":
        listen = "localhost"
    elif case == "inuse":
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        listen = f"127.0.0.1:{blocker.getsockname()[1]}"
    run = run_cfrun(["peer", "--listen", listen, "--flush-to", str(tmp_path / "l2"),
                     "--token-file", str(token)], cwd=tmp_path, timeout=60)
    if blocker is not None:
        blocker.close()
    assert run.returncode == code, run.stderr
    assert needle in run.stderr and run.stderr.startswith("cfrun: error:")
    assert len(run.stderr.strip().splitlines()) <= 2  # the error and a hint


def test_run_with_peer_but_no_token_file_or_a_bad_job_name_is_refused(tmp_path):
    run = run_cfrun(["--peer", "127.0.0.1:7077", SLOW, "3", "out.pt", "0"], cwd=tmp_path,
                    timeout=60)
    assert run.returncode == 2 and "--peer-token-file" in run.stderr
    token = write_token(tmp_path / "token")
    run = run_cfrun(["--peer", "127.0.0.1:7077", "--peer-token-file", str(token), "--job-dir",
                     "my job", SLOW, "3", "out.pt", "0"], cwd=tmp_path, timeout=60)
    assert run.returncode == 2 and "CFRUN_PEER_JOB" in run.stderr, run.stderr
    assert not (tmp_path / "cfrun-jobs").exists() and not (tmp_path / "my job").exists()
