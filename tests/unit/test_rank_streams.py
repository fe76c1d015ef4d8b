"""A rank on a terminal writes each line of its output whole (``line_buffer_terminals``): torchrun
starts ranks with ``python -u``, under which ``print`` writes its text and its newline apart,
and the supervisor's progress line, written to the same terminal, once landed between them
("step 9cfrun: step 9 ..."). Plain ``python script.py`` line-buffers a terminal; so does a
rank now. A pipe, and a ``PYTHONUNBUFFERED`` the user set, keep what they had."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT, run_on_a_terminal

CHILD = ("import sys\n"
         "from cfrun.rank.install import line_buffer_terminals\n"
         "line_buffer_terminals()\n"
         "o, e = sys.stdout, sys.stderr\n"
         "print('STATE', o.isatty(), o.line_buffering, o.write_through, e.line_buffering, "
         "e.write_through)\n")


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(more)
    return env


def _on_a_terminal(env: dict[str, str]) -> str:
    out = run_on_a_terminal([sys.executable, "-u", "-c", CHILD], env)
    return next(line for line in out.decode().splitlines() if line.startswith("STATE"))


def test_a_rank_under_python_u_line_buffers_its_terminal():
    # isatty, stdout line-buffered, stdout write-through, stderr line-buffered, write-through
    assert _on_a_terminal(_env()) == "STATE True True False True False"


def test_the_users_pythonunbuffered_and_a_pipe_are_left_alone():
    assert _on_a_terminal(_env(PYTHONUNBUFFERED="1")) == "STATE True False True False True"
    piped = subprocess.run([sys.executable, "-u", "-c", CHILD], env=_env(), text=True,
                           capture_output=True, timeout=60)
    assert piped.stdout.strip() == "STATE False False True False True", piped.stderr
