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
        f.write(json.dumps({"t": time.monotonic(), **kw}) + "\\n")

@pytest.mark.timing
def test_timing():
    _log(timing="start", nice=os.nice(0))
    time.sleep(4)
    _log(timing="end")

@pytest.mark.slow  # deselected (-m "not slow"): the workers must not wait for it
@pytest.mark.timing
def test_timing_of_another_tier():
    pass

@pytest.mark.parametrize("i", range(8))
def test_other(i):
    _log(other=i, nice=os.nice(0))
    time.sleep(1)
'''


def test_workers_yield_to_the_timing_tests_only_while_they_run(tmp_path):
    """While a ``timing`` test runs, the other workers' tests run niced (their wall-clock bound
    measures cfrun); once the group is done, a worker that may (root) goes back to its own
    priority, so the suite beside other work on the machine gets its share of the cores; a
    ``timing`` test of a tier the run leaves out is not waited for."""
    (tmp_path / "test_nice_probe.py").write_text(NICE_PROBE)
    log = tmp_path / "nice.jsonl"
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                        "no:cacheprovider", "-n", "2", "-m", "not slow", "-q",
                        str(tmp_path / "test_nice_probe.py")],
                       cwd=ROOT, env=clean_env({"NICE_LOG": str(log),
                                                "PYTHONPATH": str(ROOT / "tests")}),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    start = next(x["t"] for x in lines if x.get("timing") == "start")
    end = next(x["t"] for x in lines if x.get("timing") == "end")
    during = [x["nice"] for x in lines if "other" in x and start < x["t"] < end]
    after = [x["nice"] for x in lines if "other" in x and x["t"] > end + 0.5]
    assert during and after, lines
    base = os.nice(0)
    assert next(x["nice"] for x in lines if x.get("timing") == "start") == base, lines
    assert all(n >= 10 for n in during), lines
    if os.geteuid() == 0:  # may raise its priority back
        assert all(n == base for n in after), lines
