"""A deterministic failure before any checkpoint costs one attempt (issue 37, item 5): an
argparse typo under torchrun, as users launch it, and a ``KeyError`` after the first steps
with nothing committed stop after their first attempt (exit 5), not after a second start or a
crash loop of three; ``bench/early_failure.py`` measures them against plain torchrun."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, clean_env, run_cfrun

pytestmark = pytest.mark.timeout(300)
SCRIPT = ROOT / "bench" / "_early_failure_train.py"


@pytest.mark.torchrun
def test_an_argparse_typo_under_torchrun_costs_one_attempt(tmp_path):
    run = run_cfrun(["--job-dir", "j", str(SCRIPT), "--stpes", "10"], cwd=tmp_path)
    assert run.returncode == 5, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == 1, run.stderr[-3000:]
    assert run.stderr.count("unrecognized arguments: --stpes 10") >= 1
    assert "restart 1 of" not in run.stderr


def test_a_bug_before_any_checkpoint_costs_one_attempt(tmp_path):
    run = run_cfrun(["--interval", "50", "--job-dir", "j", str(SCRIPT), "--fail-at", "3"],
                    cwd=tmp_path)
    assert run.returncode == 5, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == 1, run.stderr[-3000:]
    [error] = [ln for ln in run.stderr.splitlines() if ln.startswith("cfrun: error:")]
    assert "KeyError: 'y' at step 3, before any checkpoint" in error, error
    again = run_cfrun(["--interval", "50", "--crash-loop", "0", "--max-restarts", "1",
                       "--job-dir", "k", str(SCRIPT), "--fail-at", "3"], cwd=tmp_path)
    assert again.returncode == 4 and len(again.events("attempt_start")) == 2  # asked for


@pytest.mark.extended  # a bench's smoke run (docs/tests.md)
@pytest.mark.timeout(900)
def test_the_bench_prints_every_case_against_torchrun():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "early_failure.py"), "--rounds",
                        "1"], env=clean_env(), capture_output=True, text=True, timeout=880,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in p.stdout.splitlines() if line.split()}
    for case, codes in (("usage", ["1,", "5"]), ("keyerror", ["1,", "5"]), ("ok", ["0,", "0"])):
        assert rows[case][5:] == codes and float(rows[case][2]) > 0, p.stdout
