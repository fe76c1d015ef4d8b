"""The three tiers of the suite (docs/tests.md): a case marked ``extended`` inside a ``slow``
module runs in the extended tier alone, so CI's ``-m slow`` leaves it out and ``-m ''`` runs it."""

from __future__ import annotations

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
