"""The ``--metrics`` HTTP server in one process: one path, a bounded pool, a deadline per
request (issue 24, item 6: prometheus_client's server held a thread per idle connection)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from cfrun.contract.jobdir import JobDir
from cfrun.supervisor import metrics as M


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setattr(M, "REQUEST_DEADLINE_S", 1.0)
    jd = JobDir(tmp_path / "j")
    jd.root.mkdir(mode=0o700)
    server, port = M.serve(M.JobMetrics(jd.root), "127.0.0.1:0")
    yield port
    server.shutdown()
    server.server_close()


def _scrape(port: int, path: str = "/metrics") -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_only_metrics_is_served(served):
    status, body = _scrape(served)
    assert status == 200 and b"cfrun_" in body
    assert _scrape(served, "/")[0] == 404
    assert _scrape(served, "/../../etc/passwd")[0] == 404


def test_idle_connections_hold_no_thread_and_are_cut_off(served):
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", served)) for _ in range(100)]
    time.sleep(0.5)
    assert threading.active_count() <= before + 2 * M.MAX_SCRAPES  # a worker + its deadline
    time.sleep(M.REQUEST_DEADLINE_S + 1.0)
    for s in idle:  # every one was closed: by the cap at once, or by its deadline
        s.settimeout(2)
        assert s.recv(1) == b""
        s.close()
    assert _scrape(served)[0] == 200


def _within(seconds: float, fn):
    """``fn()``'s result, or a failure if it has not returned in ``seconds`` (a daemon thread:
    a read blocked on a FIFO would hang the test run)."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(value=fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert "value" in out, f"still running after {seconds} s (blocked on a FIFO?)"
    return out["value"]


def test_status_metrics_refuse_a_fifo_and_a_link_without_reading_them(tmp_path) -> None:
    """Issue 32, finding 6: ``cfrun status --metrics`` read ``config.json`` through a link
    whole (a 2 GB file: 2 GB RSS) and hung on a FIFO ``events.jsonl``. Now the metrics reader
    opens both without following a link or waiting on a FIFO, and reads a bounded config; the
    command refuses either in one line (exit 2), and ``--plot``'s events reader as well."""
    import os

    from typer.testing import CliRunner

    from cfrun.cli import app as A
    from cfrun.contract.errors import BadInputError

    jd = JobDir(tmp_path / "j")
    jd.create()
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: its size, not its blocks, is the point
        f.truncate((16 << 20) + 1)  # over what a config.json may be
    os.symlink(big, jd.config_path)
    os.mkfifo(jd.events_path)
    body = _within(10, lambda: M.JobMetrics(jd.root).exposition())
    assert b"cfrun_checkpoints_total 0.0" in body
    assert _within(10, jd.read_events) == []
    for args in (["status", str(jd.root), "--metrics"],
                 ["status", str(jd.root), "--plot", str(tmp_path / "p.png")]):
        result = _within(10, lambda a=args: CliRunner().invoke(A.app, a))
        assert isinstance(result.exception, BadInputError), (args, result.output)
        said = str(result.exception)
        assert "is refused" in said and "\n" not in said
    os.unlink(jd.config_path)
    jd.config_path.write_text('{"overhead": 0.05}')
    result = _within(10, lambda: CliRunner().invoke(A.app, ["status", str(jd.root), "--metrics"]))
    assert isinstance(result.exception, BadInputError) and "a FIFO" in str(result.exception)
