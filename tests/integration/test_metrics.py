"""Prometheus metrics (issue 15, item 9): scraped over HTTP from a running job, written to the
job dir's metrics.prom, printed by cfrun status --metrics; the numbers match the job's events."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import SCRIPTS, cfrun_in_process, clean_env

from cfrun.contract import faults
from cfrun.contract.checkpoints import committed_steps

pytestmark = pytest.mark.timeout(300)


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample in Prometheus' text format."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.slow
def test_metrics_are_served_while_the_job_runs_and_kept_in_the_job_dir(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j", "--inject-crash",
         "12", "--metrics", "127.0.0.1:0", str(SCRIPTS / "slow_steps.py"), "40", "out.pt",
         "0.05"], cwd=tmp_path, env=clean_env(), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    try:
        port = None
        lines = []
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
            m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", line)
            if m:
                port = int(m.group(1))
        assert port, "".join(lines)
        seen: dict[str, float] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    seen = _samples(r.read().decode())
            except OSError:
                break  # the job ended and took the server with it
            if seen.get('cfrun_restarts_total{cause="killed"}') == 1 and \
                    seen.get("cfrun_current_step", 0) > 15:
                break
            time.sleep(0.2)
        assert seen.get('cfrun_restarts_total{cause="killed"}') == 1, seen
        assert seen["cfrun_current_step"] > 15 and seen["cfrun_checkpoints_total"] >= 2
        assert seen["cfrun_overhead_budget_ratio"] == pytest.approx(0.035)
        assert seen['cfrun_checkpoint_stall_seconds_bucket{le="+Inf"}'] == \
            seen["cfrun_checkpoints_total"]
        _, err = proc.communicate(timeout=200)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    job = tmp_path / "j"
    textfile = job / "metrics.prom"
    assert textfile.stat().st_mode & 0o077 == 0
    final = _samples(textfile.read_text())
    assert final["cfrun_newest_committed_step"] == committed_steps(job / "checkpoints")[0]
    assert final["cfrun_current_step"] == 40 and final["cfrun_attempts_total"] == 2
    assert final["cfrun_persisted_bytes_total"] > 0
    assert final['cfrun_restarts_total{cause="killed"}'] == 1
    assert final['cfrun_restarts_total{cause="exit"}'] == 0
    printed = cfrun_in_process(["status", "j", "--metrics"], cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert _samples(printed.stdout) == final


@pytest.mark.slow
def test_status_watch_follows_a_running_job_until_it_ends(tmp_path):
    """Off a terminal, --watch prints one line per refresh with the step rate, and returns when
    the job stops running, with its final state."""
    job = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j",
         str(SCRIPTS / "slow_steps.py"), "60", "out.pt", "0.1"], cwd=tmp_path, env=clean_env(),
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "j").glob("heartbeat-rank-*")):
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        watch = subprocess.run([sys.executable, "-m", "cfrun", "status", "j", "--watch"],
                               cwd=tmp_path, env=clean_env(), text=True, capture_output=True,
                               timeout=180)
        job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert watch.returncode == 0, watch.stderr
    lines = watch.stdout.strip().splitlines()
    assert len(lines) >= 2 and all(ln.startswith("cfrun status: ") for ln in lines)
    assert lines[-1].startswith("cfrun status: succeeded, step 60")
    # a rate from the second refresh on: "(2.10 steps/s, ETA 52s)", or "(0.00 steps/s)" once
    # the step stands still (the ETA is then unknown); which one the last refresh shows
    # depends on whether the job's last step came between the last two refreshes
    assert any(re.search(r"\(\d+\.\d\d steps/s(, ETA [^)]+)?\)", ln) for ln in lines[1:]), lines
    assert "None" not in watch.stdout


def run_events(job, kind: str) -> list[dict]:
    return [e for e in (json.loads(line) for line in (job / "events.jsonl").read_text()
                        .splitlines() if line.strip()) if e["event"] == kind]


def test_status_estimates_progress_over_a_range_epoch_loop_and_the_eta(tmp_path):
    """A loader of known length under ``for epoch in range(...)``: the checkpoint events carry
    the batches done and in all, each as it was at its own boundary, status --json shows them,
    and --watch's ETA follows."""
    from cfrun.contract.progress import eta_s, fmt_duration

    # commits 0.3 s late: a checkpoint's event is written after later boundaries (its
    # progress once came from one of them: step 80 said 92 batches done)
    run = subprocess.run([sys.executable, "-m", "cfrun", "--interval", "10", "--job-dir", "j",
                          str(SCRIPTS / "train_tiny.py"), "--epochs", "4", "--out", "o.pt"],
                         cwd=tmp_path, env=clean_env(faults.arm({}, **{
                             "agent.commit_delay_s": 0.3})), text=True, capture_output=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    st = json.loads(cfrun_in_process(["status", "j", "--json"], cwd=tmp_path).stdout)
    p = st["progress"]
    assert p["total_batches"] == 4 * 23  # train_tiny: 23 batches per epoch
    assert p["done_batches"] == p["step"] and 0 < p["step"] <= 92  # one step per batch
    for e in run_events(tmp_path / "j", "checkpoint"):  # each its own boundary's progress
        assert e["progress"]["done_batches"] == e["step"], e
    assert st["total_steps"] == 92  # the run's end, from the epoch loop (issue 37, item 4)
    assert eta_s(p["step"], st["total_steps"], 2.0) == pytest.approx((92 - p["step"]) / 2.0)
    assert eta_s(p["step"], None, 2.0) is None
    assert [fmt_duration(x) for x in (12, 245, 3725)] == ["12s", "4m05s", "1h02m"]
