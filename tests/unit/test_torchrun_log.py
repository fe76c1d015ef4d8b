"""The torchrun wrapper (cfrun.supervisor.torchrun_log) leaves without the interpreter's teardown
but with the exit status, the report in the log and the atexit handlers an ordinary exit has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

MODULE = """
import atexit, sys
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
how = sys.argv[2]
if how == "raise":
    raise RuntimeError("the report: rank 1 (local_rank: 1)")
if how == "exit":
    sys.exit(int(sys.argv[3]))
if how == "message":
    sys.exit("a message")
print("done", flush=True)
"""


@pytest.mark.parametrize("how, extra, status, in_log", [
    ("raise", [], 1, "RuntimeError: the report: rank 1 (local_rank: 1)"),
    ("exit", ["3"], 3, ""),
    ("exit", ["0"], 0, ""),
    ("message", [], 1, "a message"),
    ("return", [], 0, ""),
])
def test_exit_status_log_and_atexit(tmp_path: Path, how, extra, status, in_log) -> None:
    (tmp_path / "fake_launcher.py").write_text(MODULE)
    log, marker = tmp_path / "attempt-0.log", tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    p = subprocess.run([sys.executable, "-m", "cfrun.supervisor.torchrun_log", str(log),
                        "fake_launcher", str(marker), how, *extra],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == status, p.stderr
    assert marker.read_text() == "atexit ran"
    text = log.read_text()
    assert in_log in text
    if how == "raise":
        assert "Traceback" in text and p.stderr == ""  # the report goes to the log only
    if how == "return":
        assert p.stdout == "done\n"


def test_torchruns_parser_gets_its_own_options_and_the_script_only() -> None:
    """build_torchrun_argv writes each of torchrun's options as one word; the first other word
    is the script, and what follows is the script's, never parsed by torchrun (``--d 3`` is an
    ambiguous abbreviation of two of torchrun's options there)."""
    from cfrun.contract.config import RunConfig
    from cfrun.supervisor.launcher import build_torchrun_argv
    from cfrun.supervisor.torchrun_log import TORCHRUN, split_script

    args = ["--d", "3", "--nproc", "7", "--", "x"]
    cfg = RunConfig(script="/s/train.py", script_args=args, job_dir="/j", cwd="/",
                    nproc_per_node=2, local_addr="10.0.0.1")
    argv = build_torchrun_argv(cfg, python="py", log_path="/j/log")
    assert argv[:2] == ["py", "-c"]  # the working directory off sys.path (module_argv)
    i = argv.index("cfrun.supervisor.torchrun_log")
    assert argv[i + 1:i + 3] == ["/j/log", TORCHRUN]
    own, script_args = split_script(argv[i + 3:])
    assert own[-1] == "/s/train.py" and script_args == args
    assert all(word.startswith("--") for word in own[:-1])
    from torch.distributed.run import parse_args

    parsed = parse_args(own)
    assert parsed.nproc_per_node == "2" and parsed.training_script_args == []
