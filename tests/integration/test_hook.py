"""The sitecustomize hook: ranks only, no torch import of its own, chaining, never fatal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, SCRIPTS, clean_env, run_cfrun

from cfrun.contract import faults

pytestmark = pytest.mark.timeout(300)  # the default: a loaded machine took over 120 s (issue 36)


@pytest.mark.parametrize("standby", ["0", "1"])
def test_inert_without_torch_and_in_child_processes(tmp_path, standby):
    """cfrun's hook never imports torch: a rank started as ``python SCRIPT``
    (``CFRUN_STANDBY=0``) of a script that never imports torch finds none imported, the hook
    armed. With warm spares (the default) the rank starts as a spare, which imported torch
    ahead (docs: recovery; a job imports torch once however often it restarts), and the
    script runs as written. Either way the script's own child processes get no hook."""
    run = run_cfrun(["--job-dir", "j", str(SCRIPTS / "no_torch.py")], cwd=tmp_path,
                    env={"CFRUN_STANDBY": standby})
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert f"torch imported: {standby == '1'}" in lines
    assert "cfrun.rank imported: True" in lines  # the rank's hook is armed
    assert "child cfrun.rank imported: False False" in lines


def test_chains_user_sitecustomize_and_still_checkpoints(tmp_path):
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("print('USER SITECUSTOMIZE RAN', flush=True)\n")
    run = run_cfrun(["--interval", "5", "--job-dir", "j", str(SCRIPTS / "train_steps_for.py"),
                     "12", "out.pt"], cwd=tmp_path, env={"PYTHONPATH": str(user_site)})
    assert run.returncode == 0, run.stderr
    assert "USER SITECUSTOMIZE RAN" in run.stdout
    steps = [e["step"] for e in run.events("checkpoint")]
    assert steps and steps[0] == 5  # later ones may be deferred while step 5 persists


def test_runtime_failure_leaves_job_running_unprotected(tmp_path):
    env = clean_env({
        "PYTHONPATH": str(ROOT / "hooks"), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
        "CFRUN_RANK_SETTINGS": json.dumps({"job_dir": str(tmp_path / "j"),
                                           "script": str(SCRIPTS / "train_steps_for.py"),
                                           "interval": "not-a-number"}),
    })
    p = subprocess.run([sys.executable, str(SCRIPTS / "train_steps_for.py"), "5",
                        str(tmp_path / "o.pt")], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "UNPROTECTED" in p.stderr
    assert "FINAL" in p.stdout
    assert not (tmp_path / "j" / "checkpoints").exists()


def test_internal_error_in_step_hook_leaves_job_running_unprotected(tmp_path):
    """cfrun's optimizer step hook raises at step 5 (fault point rank.raise_in_step): the script
    is not broken, it
    finishes in the same attempt with one loud warning, and cfrun takes no more checkpoints."""
    run = run_cfrun(["--interval", "3", "--job-dir", "j", str(SCRIPTS / "train_steps_for.py"),
                     "12", "out.pt"], cwd=tmp_path,
                    env=faults.arm({}, **{"rank.raise_in_step": 5}))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "FINAL" in run.stdout and "it 11" in run.stdout
    assert (tmp_path / "out.pt").exists()
    assert run.stderr.count("UNPROTECTED") == 1, run.stderr[-3000:]
    assert "injected internal error at step 5" in run.stderr
    assert len(run.events("attempt_start")) == 1  # no crash, no restart
    [event] = run.events("unprotected")
    assert event["step"] == 5 and event["where"] == "the optimizer step hook"
    assert [e["step"] for e in run.events("checkpoint")] == [3]  # none after the failure
