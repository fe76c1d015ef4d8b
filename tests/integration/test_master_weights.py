"""fp32 master weights held by an optimizer over standalone parameters (issue 18, item 3).

``train_master_weights.py`` trains a bf16 (or fp32) model through an optimizer over
``nn.Parameter(p.float())`` copies that no module owns, copying them back into the model after
each step. The plain script, an uninterrupted cfrun run and a cfrun run SIGKILLed at chosen
steps must save bit-identical final models, masters and optimizer states: a resume that skipped
the masters would restart them from their initial values while the moments are restored.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, clean_env, run_cfrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SCRIPT = str(SCRIPTS / "train_master_weights.py")
STEPS = 30


def _plain(cwd: Path, dtype: str) -> dict:
    p = subprocess.run([sys.executable, SCRIPT, "--out", "plain.pt", "--steps", str(STEPS),
                        "--dtype", dtype], cwd=cwd, env=clean_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(cwd / "plain.pt", weights_only=True)


def _cfrun(cwd: Path, name: str, dtype: str, kills: str = "") -> dict:
    inject = ["--inject-crash", kills] if kills else []
    run = run_cfrun(["--interval", "4", *inject, "--job-dir", name, SCRIPT, "--out",
                     f"{name}.pt", "--steps", str(STEPS), "--dtype", dtype], cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    n_kills = len(kills.split(",")) if kills else 0
    assert len(run.events("attempt_start")) == n_kills + 1, run.stderr[-3000:]
    assert len(run.events("resumed")) >= n_kills, run.stderr[-3000:]
    assert not run.events("not_exact"), run.events("not_exact")
    assert not run.events("unprotected"), run.events("unprotected")
    return torch.load(cwd / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp32", marks=pytest.mark.extended)])
def test_master_weights_resume_bit_exactly_after_kills(tmp_path, dtype):
    ref = _plain(tmp_path, dtype)
    assert_bit_identical(ref, _cfrun(tmp_path, "plain", dtype))
    # kills after steps 9 (attempt 0) and 22 (attempt 1): each resumes from an earlier step
    assert_bit_identical(ref, _cfrun(tmp_path, "kills", dtype, kills="9@0,22@1"))
