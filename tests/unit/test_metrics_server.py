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
