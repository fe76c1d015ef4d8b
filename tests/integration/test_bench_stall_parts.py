"""bench/stall_parts.py runs: this checkout against itself (``--cfrun-root`` the repository), one
round of a few steps; every figure of its table is printed for both. Not timed: the numbers are
not judged, only that each one is there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, clean_env

pytestmark = pytest.mark.extended  # a bench's smoke run (docs/tests.md)


@pytest.mark.timeout(600)
def test_stall_parts_bench_prints_every_part_for_both_checkouts():
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "stall_parts.py"), "--cfrun-root",
                        str(ROOT), "--rounds", "1", "--steps", "25", "--interval", "10"],
                       env=clean_env(), capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in p.stdout.splitlines()
            if line.split() and line.split()[0] in ("this", "other", "ratio")}
    assert set(rows) == {"this", "other", "ratio"}, p.stdout
    for name in ("this", "other"):  # first stall, stall, capture, enqueue: all measured
        assert len(rows[name]) == 4 and all(float(x) > 0 for x in rows[name]), p.stdout
