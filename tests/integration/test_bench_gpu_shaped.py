"""bench/gpu_shaped.py runs end to end and reports a per-checkpoint cost per cfrun row
(issue 33: the GPU-shaped step on a CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

pytestmark = [pytest.mark.extended,  # a bench's smoke run (docs/tests.md)
              pytest.mark.timeout(600)]


def test_gpu_shaped_bench_reports_the_per_checkpoint_cost_part_by_part(tmp_path: Path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_shaped.py"), "--steps", "40",
                        "--policy-steps", "70", "--state-mb", "8", "--device-ms", "20",
                        "--launches", "40", "--out", str(out)], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=550)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "per-checkpoint cost in steps" in p.stdout, p.stdout
    summary = json.loads(out.read_text())["summary"]
    for name in ("cfrun_k", "cfrun_2k"):
        row = summary[name]
        assert row["checkpoints"] >= 2, row
        for part in ("boundary", "next", "persist", "total", "stall_ms"):
            assert row[part] is not None, (name, part, row)
    assert summary["plain"]["checkpoints"] == 0
