"""The three tiers of the suite (docs/tests.md): a case marked ``extended`` inside a ``slow``
module runs in the extended tier alone, so CI's ``-m slow`` leaves it out and ``-m ''`` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env

FILE = "tests/integration/test_master_weights.py"  # a slow module; its fp32 case is extended


def _collected(*marks: str) -> set[str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                        "-p", "no:cacheprovider", *marks, FILE], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 5), p.stdout[-2000:] + p.stderr[-2000:]
    return {line.rsplit("[", 1)[-1].rstrip("]") for line in p.stdout.splitlines()
            if "::" in line}


@pytest.mark.parametrize("marks, want", [
    ((), set()),                    # the quick tier: the module is slow
    (("-m", "slow"), {"bf16"}),     # CI's slow tier: the extended case left out
    (("-m", "extended"), {"fp32"}),
    (("-m", ""), {"bf16", "fp32"}),  # every tier
], ids=["quick", "slow", "extended", "all"])
def test_each_case_runs_in_its_tier_alone(marks, want):
    assert _collected(*marks) == want


NICE_PROBE = '''
import json, os, time
import pytest

def _log(**kw):
    with open(os.environ["NICE_LOG"], "a") as f:
        f.write(json.dumps({"t": time.monotonic(), "worker": os.environ["PYTEST_XDIST_WORKER"],
                            "nice": os.nice(0), **kw}) + "\\n")

@pytest.mark.timing
@pytest.mark.parametrize("i", range(3))
def test_timing(i):
    _log(timing="start")
    time.sleep(1.5)
    _log(timing="end")

@pytest.mark.slow  # deselected (-m "not slow"): the workers must not wait for it
@pytest.mark.timing
def test_timing_of_another_tier():
    pass

@pytest.mark.parametrize("i", range(8))
def test_other(i):
    _log(other=i)
    time.sleep(1)
'''


def test_workers_yield_to_the_timing_tests_only_while_they_run(tmp_path):
    """The ``timing`` tests run as one xdist group (one worker, one at a time) at the normal
    priority; meanwhile the other workers' tests run niced (a wall-clock bound measures cfrun);
    once they are done, a worker that may (root) goes back to its own priority, so the suite
    beside other work on the machine gets its share of the cores; a ``timing`` test of a tier
    the run leaves out is not waited for. Run with the suite's options (pyproject.toml): the
    group fails with pytest 9.2 (pytest-xdist#1386) or a conftest hook after xdist's."""
    (tmp_path / "test_nice_probe.py").write_text(NICE_PROBE)  # run with the suite's own options
    log = tmp_path / "nice.jsonl"
    p = subprocess.run([sys.executable, "-m", "pytest", "-c", "pyproject.toml", "-p", "conftest",
                        "-p", "no:cacheprovider", "-n", "2", "-m", "not slow", "-q",
                        str(tmp_path / "test_nice_probe.py")],
                       cwd=ROOT, env=clean_env({"NICE_LOG": str(log),
                                                "PYTHONPATH": str(ROOT / "tests")}),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    timing = [x for x in lines if "timing" in x]
    assert len({x["worker"] for x in timing}) == 1, lines  # one group, one at a time
    start, end = timing[0]["t"], timing[-1]["t"]
    during = [x["nice"] for x in lines if "other" in x and start < x["t"] < end]
    after = [x["nice"] for x in lines if "other" in x and x["t"] > end + 0.5]
    assert during and after, lines
    base = os.nice(0)
    assert all(x["nice"] == base for x in timing), lines
    assert all(n >= 10 for n in during), lines
    if os.geteuid() == 0:  # may raise its priority back
        assert all(n == base for n in after), lines
