"""The processes that never touch a tensor run with torch made unimportable.

``cfrun status``, ``cfrun ls``, the persist agent (``python -m cfrun.agent``), ``cfrun peer``
and the supervisor's modules must not import torch (issue 12, item 2): they start faster, use
less memory, and run where torch is absent or broken. Each runs here as a real process with a
``torch`` package first on ``PYTHONPATH`` whose import raises, so adding a torch import back to
any of them (directly or through a module it imports) fails this test.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

pytestmark = pytest.mark.timeout(300)  # the default: a loaded machine took over 120 s (issue 36)


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    blocker = tmp_path_factory.mktemp("blocker")
    (blocker / "torch").mkdir()
    (blocker / "torch" / "__init__.py").write_text(
        'raise ImportError("torch is blocked: this process must not import torch")\n')
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(ROOT)])
    return env


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job dir with two committed checkpoints (written in this process, with torch)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_crafted_cli import make_job

    return make_job(tmp_path_factory.mktemp("job"))


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], check=False, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_blocker_blocks(no_torch_env: dict[str, str], tmp_path: Path) -> None:
    run = _run(["-c", "import torch"], no_torch_env, tmp_path)
    assert run.returncode != 0 and "torch is blocked" in run.stderr


def test_status_and_ls_without_torch(no_torch_env: dict[str, str], job: Path) -> None:
    status = _run(["-m", "cfrun", "status", str(job), "--json"], no_torch_env, job.parent)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["last_committed_step"] == 20
    ls = _run(["-m", "cfrun", "ls", str(job), "--json"], no_torch_env, job.parent)
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)
    assert [(r["step"], r["verified"]) for r in rows] == [(20, "ok"), (10, "ok")]


def test_supervisor_modules_import_without_torch(no_torch_env: dict[str, str],
                                                 tmp_path: Path) -> None:
    code = ("import sys, cfrun.supervisor.launcher, cfrun.contract.checkpoints, "
            "cfrun.storage.tiers, cfrun.cli.inspect; assert 'torch' not in sys.modules")
    run = _run(["-c", code], no_torch_env, tmp_path)
    assert run.returncode == 0, run.stderr


def test_supervisor_core_imports_without_torch(no_torch_env: dict[str, str],
                                               tmp_path: Path) -> None:
    run = _run(["-c", "import sys, cfrun.supervisor.core; assert 'torch' not in sys.modules"],
               no_torch_env, tmp_path)
    assert run.returncode == 0, run.stderr


def _wait_for(predicate, proc: subprocess.Popen[str], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {what}: {err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.05)


def test_agent_starts_and_stops_without_torch(no_torch_env: dict[str, str],
                                              tmp_path: Path) -> None:
    jd = tmp_path / "j"
    (jd / "checkpoints").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "cfrun.agent", "--job-dir", str(jd)],
                            cwd=tmp_path, env=no_torch_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    events = jd / "events.jsonl"
    _wait_for(lambda: events.exists() and "agent_start" in events.read_text(), proc,
              "agent_start event")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_peer_starts_and_stops_without_torch(no_torch_env: dict[str, str],
                                             tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "cfrun", "peer", "--listen", "127.0.0.1:0",
                             "--flush-to", str(tmp_path / "l2"), "--token-file", str(token)],
                            cwd=tmp_path, env=no_torch_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        lines.extend(proc.stderr)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    _wait_for(lambda: any("listening on 127.0.0.1:" in line for line in lines), proc,
              "'listening on' line")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    reader.join(10)
    err = "".join(lines)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
