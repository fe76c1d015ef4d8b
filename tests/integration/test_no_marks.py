"""Nothing of cfrun reaches the script's own files (issue 14, item 6): the state_dicts a script
saves under cfrun hold no cfrun key or value and equal, bit for bit, those of a plain run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, clean_env, final_line, run_cfrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "plateau.pt", "scaler.pt")


def _strings(tree: object) -> list[str]:
    """Every key and string value in a nested state, as text."""
    if isinstance(tree, dict):
        return [s for k, v in tree.items() for s in [str(k), *_strings(v)]]
    if isinstance(tree, (list, tuple)):
        return [s for v in tree for s in _strings(v)]
    return [str(tree)] if isinstance(tree, str) else []


def test_saved_state_dicts_carry_no_cfrun_mark(tmp_path: Path) -> None:
    plain, under = tmp_path / "plain", tmp_path / "cfrun"
    plain.mkdir()
    under.mkdir()
    p = subprocess.run([sys.executable, str(SCRIPTS / "save_states.py"), str(plain)],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    run = run_cfrun(["--interval", "2", "--job-dir", "job", str(SCRIPTS / "save_states.py"),
                     str(under)], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in FILES:
        mine = torch.load(under / name, weights_only=True)
        ref = torch.load(plain / name, weights_only=True)
        assert not [s for s in _strings(mine) if "cfrun" in s], (name, mine)
        assert_bit_identical(mine, ref, name)


def test_script_variables_of_common_types_survive_a_kill(tmp_path: Path) -> None:
    """Issue 14, item 4: an Enum-holding meter, a dataclass, a namedtuple, collections
    containers, a datetime and a Path as script variables come back after a SIGKILL."""
    script = str(SCRIPTS / "script_vars.py")
    p = subprocess.run([sys.executable, script], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    run = run_cfrun(["--interval", "5", "--job-dir", "job", "--inject-crash", "33", script],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.events("resumed"), run.stderr[-3000:]
    assert "cannot be stored" not in run.stdout + run.stderr
    assert final_line(run.stdout) == final_line(p.stdout)
