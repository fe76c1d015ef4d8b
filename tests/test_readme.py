"""README.md's quickstart: exactly two commands, and the demo it runs works and says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env


def test_ci_runs_exactly_the_readme_commands():
    """The quickstart has exactly two commands (the demo, the quick tier of the tests); CI runs
    them as written, then the slow tier, whose command README's "Tests" gives."""
    text = (ROOT / "README.md").read_text()
    quickstart = text[text.index("## Quickstart"):text.index("\n## ", text.index("## Quickstart"))]
    assert quickstart.count("<!-- command: ") == 2
    assert text.count("<!-- command: ") == 3 and "<!-- command: slow-tests -->" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert all(f"command_after {c}" in ci for c in ("demo", "tests", "slow-tests"))
    out = subprocess.run(["bash", "-c", "source <(sed -n '/^command_after()/,/^}/p' .ci/run); "
                          "command_after demo; command_after tests; command_after slow-tests"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].endswith("bash examples/quickstart.sh")
    assert out[1].endswith("python -m pytest")
    assert ".venv/bin/ruff check && .venv/bin/mypy && " in out[1]  # lint and types gate the tests
    assert out[2] == ".venv/bin/python -m pytest -m slow"


@pytest.mark.timeout(300)
@pytest.mark.extended  # CI runs the same script as its first command, which fails on a mismatch
@pytest.mark.spares  # as the README's command runs it
def test_quickstart_demo_crashes_resumes_and_matches(tmp_path):
    """The demo script of the README's first command, with this interpreter's cfrun."""
    env = clean_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    p = subprocess.run(["bash", str(ROOT / "examples" / "quickstart.sh")], env=env,
                       capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "injected crash: SIGKILL after step 110" in p.stderr
    assert "resumed at step 100" in p.stderr
    assert "IDENTICAL, bit for bit" in p.stdout
