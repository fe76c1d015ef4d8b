"""bench/suite_cpu.py: where a pytest run's CPU-seconds go. Its parsing on records made here
(quick), and one run of it over a real test of a killed and resumed job (extended: it needs root
and ``accton``, and turns the machine's process accounting on and off)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT, clean_env

sys.path.insert(0, str(ROOT / "bench"))
import suite_cpu  # noqa: E402


def _record(pid: int, ppid: int, cpu_ticks: int, comm: bytes) -> bytes:
    return suite_cpu.ACCT_V3.pack(b"\0", b"\3", 0, 0, 0, 0, pid, ppid, 0, 0.0, cpu_ticks, 0,
                                  0, 0, 0, 0, 0, 0, comm)


def test_each_process_gets_its_kind_and_test_up_its_parents(tmp_path):
    """A rank forked without a new interpreter (a warm spare) counts as a rank of the test whose
    ``cfrun`` command it descends from; a script outside a ``cfrun`` command is a plain run;
    ``comp_t`` times are decoded (8191 ticks, then 2 x 8**1 ticks)."""
    test = "tests/x.py::test_a (call)"
    starts = [{"pid": 10, "ppid": 1, "argv": ["py", "-m", "cfrun", "s.py"], "test": test},
              {"pid": 11, "ppid": 10, "argv": ["py", "-c", "runpy.run_module(...)", "/r",
                                               "cfrun.rank.spare", "--", "s.py"], "test": test},
              {"pid": 20, "ppid": 1, "argv": ["py", "s.py"], "test": test}]
    (tmp_path / "starts.jsonl").write_text("".join(json.dumps(d) + "\n" for d in starts)
                                           + '{"pid": 3')  # a line cut by a kill
    (tmp_path / "pacct").write_bytes(
        _record(10, 1, 100, b"python") + _record(11, 10, 8191, b"python")
        + _record(12, 10, (1 << 13) | 2, b"python")  # the spare forked from 11, reparented
        + _record(20, 1, 300, b"python") + _record(99, 1, 5000, b"bash"))  # not the run's
    by_kind, by_test, n = suite_cpu.account(tmp_path / "pacct", tmp_path / "starts.jsonl")
    assert n == 5
    assert {k: round(v, 2) for k, v in by_kind.items()} == {
        "rank": 82.07, "plain script": 3.0, "cfrun command": 1.0}
    assert {k: round(v, 2) for k, v in by_test.items()} == {test.split(" ")[0]: 86.07}
    assert "rank" in suite_cpu.report(tmp_path / "pacct", tmp_path / "starts.jsonl", 5)


@pytest.mark.extended  # a bench's smoke run (docs/tests.md)
@pytest.mark.skipif(shutil.which("accton") is None or os.geteuid() != 0,
                    reason="needs root and accton (Debian's acct)")
@pytest.mark.timeout(600)
def test_the_bench_counts_the_ranks_of_a_real_killed_job(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "suite_cpu.py"), "--out",
                        str(tmp_path), "--", "-n", "0", "-m", "",
                        "tests/integration/test_crash_resume.py::"
                        "test_sigkill_resume_is_bit_identical"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    kinds = {line.split("  ")[-1].strip(): float(line.split()[0])
             for line in p.stdout.split("CPU-s  share  kind")[1].split("the ")[0].splitlines()
             if line.strip()}
    assert kinds["rank"] > 1 and kinds["cfrun command"] > 0, p.stdout
    assert "test_sigkill_resume_is_bit_identical" in p.stdout
    assert not (Path(sysconfig.get_paths()["purelib"]) / "_suite_cpu_log.pth").exists()
