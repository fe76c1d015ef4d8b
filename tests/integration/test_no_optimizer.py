"""A script with no torch.optim optimizer (parameters updated by hand) is unprotected: cfrun
says so once on stderr, as an ``unprotected`` event and in ``cfrun status``."""

from __future__ import annotations

import json

import pytest
from conftest import SCRIPTS, run_cfrun

pytestmark = pytest.mark.timeout(300)
BY_HAND = str(SCRIPTS / "train_by_hand.py")


def test_updates_by_hand_warn_once_and_status_says_unprotected(tmp_path):
    run = run_cfrun(["--interval", "5", "--job-dir", "j", BY_HAND, "300"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "FINAL loss" in run.stdout
    warnings = [l for l in run.stderr.splitlines() if "no torch.optim optimizer stepped" in l]
    assert len(warnings) == 1, run.stderr[-3000:]
    assert "unprotected" in warnings[0] and "WARNING" in warnings[0]
    [event] = run.events("unprotected")
    assert event["where"] == "no optimizer" and "backward()" in event["error"]
    assert not run.events("checkpoint")
    status = run_cfrun(["status", "--json", "j"], cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    [u] = json.loads(status.stdout)["unprotected"]
    assert u["where"] == "no optimizer"
    table = run_cfrun(["status", "j"], cwd=tmp_path)
    assert "UNPROTECTED" in table.stdout, table.stdout


@pytest.mark.slow
def test_an_optimizer_script_gets_no_such_warning(tmp_path):
    run = run_cfrun(["--interval", "50", "--job-dir", "j", BY_HAND, "300", "opt"],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no torch.optim optimizer stepped" not in run.stderr
    assert not run.events("unprotected")
    assert run.events("checkpoint")
    status = run_cfrun(["status", "--json", "j"], cwd=tmp_path)
    assert json.loads(status.stdout)["unprotected"] == []
