"""Issue 27, item 7: a loop temporary larger than cfrun can store raises no false alarm and
is not stored; a large tensor the loop reads across steps is still reported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, plain_run, run_cfrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_loop_temporary_raises_no_alarm_and_the_resume_stays_exact(tmp_path: Path) -> None:
    script = str(SCRIPTS / "loop_temporaries.py")
    plain_run([script, str(tmp_path / "ref.pt")], tmp_path)
    run = run_cfrun(["--interval", "2", "--inject-crash", "5", "--job-dir", "job", script,
                     str(tmp_path / "got.pt")], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.events("resumed"), run.stderr[-3000:]
    reasons = [e["reason"] for e in run.events("not_exact")]
    assert any("<module>:carry (tensors too large" in r for r in reasons), reasons
    assert not [r for r in reasons if "logits" in r], reasons
    assert "logits" not in run.stdout + run.stderr
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert_bit_identical(got, ref)
