"""The console tap's file (cfrun.supervisor.console), with a real child process writing to it:
lines whole, an endless line kept in bounded pieces, the file private."""

from __future__ import annotations

import stat
import subprocess
import sys

from cfrun.supervisor.console import ConsoleTap


def test_an_unfinished_line_is_kept_in_bounded_pieces_and_the_rest_whole(tmp_path):
    tap = ConsoleTap().open()
    try:
        assert set(tap.popen_kwargs()) == {"stdout", "stderr"}  # pytest's captured fds
        tap.keep_in(tmp_path / "out.log")
        code = ("import sys; sys.stdout.write('a' * 200000); sys.stdout.flush(); "
                "sys.stderr.write('err\\n'); sys.stderr.flush(); print('end')")
        subprocess.run([sys.executable, "-c", code], check=True, **tap.popen_kwargs())
        assert tap.drain(5.0)
        # held back: at most one piece, not the whole 200 kB line
        assert max(len(s.partial) for s in tap._streams) == 0
    finally:
        tap.close()
    path = tmp_path / "out.log"
    text = path.read_text()
    # stdout and stderr are two pipes here: stderr's line may come first, last, or between two
    # pieces of the long stdout line (a piece is written once it reaches its bound: on a busy
    # machine the reader of stdout may have written one before stderr's line came)
    assert text.count("err\n") == 1 and text.replace("err\n", "") == "a" * 200000 + "end\n"
    assert text.endswith("\n") and text.count("\n") >= 2
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
