"""Goodput (issue 35): ``cfrun status`` splits a job's wall time into productive training and
what was lost per cause, checked against a job whose kills the test chose."""

from __future__ import annotations

import json

import pytest
from conftest import SCRIPTS, run_cfrun

from cfrun.contract.goodput import CAUSES, timeline

pytestmark = pytest.mark.timeout(300)
KILLS = (15, 35)


def test_status_gives_the_ettr_and_the_time_lost_per_cause_of_a_job_killed_twice(tmp_path):
    run = run_cfrun(["--interval", "10", "--job-dir", "j",
                     "--inject-crash", f"{KILLS[0]}@0,{KILLS[1]}@1",
                     str(SCRIPTS / "train_tiny.py"), "--epochs", "3", "--out", "got.pt"],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = sorted(e["step"] for e in run.events("resumed") if e.get("rank", 0) == 0)
    assert len(resumed) == 2
    firsts = run.events("first_step")
    assert [e["attempt"] for e in firsts] == [0, 1, 2], firsts

    st = json.loads(run_cfrun(["status", "j", "--json"], cwd=tmp_path).stdout)
    g = st["goodput"]
    assert set(g["lost_s"]) == set(CAUSES)
    # the parts add up to the wall time, and the wall time covers every attempt
    assert g["productive_s"] + sum(g["lost_s"].values()) == pytest.approx(g["wall_s"], rel=0.01)
    attempts_s = sum(e["duration_s"] for e in run.events("attempt_end"))
    assert g["wall_s"] >= attempts_s * 0.99
    assert 0 < g["ettr"] < 1
    # what the test chose: two restarts, each recomputing the steps since its checkpoint
    assert g["restarts"] == 2
    assert g["recomputed_steps"] == sum(k - r for k, r in zip(KILLS, resumed)), (g, resumed)
    assert g["lost_s"]["restart"] > 0 and g["lost_s"]["startup"] > 0
    assert g["lost_s"]["recompute"] == pytest.approx(g["recomputed_steps"] * g["step_s"],
                                                     rel=0.01, abs=1e-3)
    stalls = sum(e["stall_s"] for e in run.events("checkpoint"))
    assert g["lost_s"]["stall"] == pytest.approx(stalls, abs=1e-3)
    # each restart's time runs from the failed attempt's end to the next first step
    ends = {e["attempt"]: e["t_unix_s"] for e in run.events("attempt_end")}
    firsts_t = {e["attempt"]: e["t_unix_s"] for e in firsts}
    expected = sum(firsts_t[a] - ends[a - 1] for a in (1, 2))
    assert g["lost_s"]["restart"] == pytest.approx(expected, abs=0.01)

    table = run_cfrun(["status", "j"], cwd=tmp_path).stdout
    assert "ETTR" in table and "restart" in table, table

    # the picture (status --plot): three attempts on the wall clock, each start-up or restart
    # span as long as goodput counts it, the two failures and every commit on it
    png = tmp_path / "timeline.png"
    plotted = run_cfrun(["status", "j", "--plot", str(png)], cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    tl = timeline(run.events())
    assert tl is not None
    kinds = [(s["attempt"], s["kind"]) for s in tl["spans"]]
    assert kinds == [(0, "startup"), (0, "training"), (1, "restart"), (1, "training"),
                     (2, "restart"), (2, "training")], kinds
    for cause in ("startup", "restart"):
        spans_s = sum(s["t1_s"] - s["t0_s"] for s in tl["spans"] if s["kind"] == cause)
        assert spans_s == pytest.approx(g["lost_s"][cause], abs=0.01), (cause, tl["spans"])
    assert [a for _, a, _ in tl["failures"]] == [0, 1]
    assert len(tl["commits"]) == len(run.events("commit"))
