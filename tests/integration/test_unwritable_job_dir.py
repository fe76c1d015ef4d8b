"""Issue 37, item 3: a job dir on a read-only or full disk. The commands that read (``status``,
``ls``, ``export``) work on it as on any other, taking no lock; the commands that must write
(``cfrun SCRIPT``, ``resume``, ``profile``, a new job dir under it) say so in one line naming
the path and the fix, exit 2, and start and change nothing.

The disk is a real tmpfs, remounted read-only (mounted here: CI runs as root, which a 0555
directory would not stop; without the right to mount, the tests skip and say why)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SCRIPTS, mounted_tmpfs, run_cfrun

pytestmark = pytest.mark.timeout(300)
TINY = [str(SCRIPTS / "train_tiny.py"), "--epochs", "1", "--out", "final.pt"]


def _listing(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.lstat().st_size, p.lstat().st_mtime_ns)
                  for p in root.rglob("*"))


def _remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True)


@pytest.fixture
def read_only_job(tmp_path: Path) -> Iterator[Path]:
    """A finished job (checkpoints of a one-epoch run) in ``mnt/j``, its disk then read-only."""
    with mounted_tmpfs(tmp_path, "64m") as mnt:
        run = run_cfrun(["--interval", "10", "--job-dir", str(mnt / "j"), *TINY], cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        _remount(mnt, "ro")
        try:
            yield mnt / "j"
        finally:
            _remount(mnt, "rw")


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("cfrun: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_a_read_only_job_dir_reads_and_refuses_to_write_in_one_line(read_only_job, tmp_path):
    job = read_only_job
    before = _listing(job)
    for args in (["status", str(job)], ["status", "--json", str(job)],
                 ["status", str(job.parent)], ["ls", str(job)],
                 ["export", str(job), str(tmp_path / "w.pt")]):
        run = run_cfrun(args, cwd=tmp_path)
        assert run.returncode == 0, (args, run.stderr[-3000:])
    assert (tmp_path / "w.pt").stat().st_size > 0
    for args, path in (
            (["resume", "--rerun", str(job)], job / "job.lock"),
            (["--rerun", "--job-dir", str(job), *TINY], job / "job.lock"),
            (["--job-dir", str(job.parent / "new"), *TINY], job.parent / "new"),
            (["profile", "--job-dir", str(job / "sub"), *TINY], job / "sub")):
        run = run_cfrun(args, cwd=tmp_path)
        assert run.returncode == 2, (args, run.stderr[-3000:])
        line = _one_line(run.stderr)
        assert "Read-only file system" in line and repr(str(path)) in line, line
        assert "remount it read-write" in line and "--job-dir" in line, line
        assert "FINAL" not in run.stdout
    assert _listing(job) == before  # nothing of the job touched
    assert sorted(os.listdir(job.parent)) == ["j"]


def test_a_job_dir_on_a_full_disk_is_one_line(tmp_path):
    """A new job dir on a disk with no byte left: its identity cannot be written."""
    with mounted_tmpfs(tmp_path, "4m") as mnt:
        with open(mnt / "ballast", "wb") as f:
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            os.posix_fallocate(f.fileno(), 0, free)
        run = run_cfrun(["--job-dir", str(mnt / "j"), *TINY], cwd=tmp_path)
        assert run.returncode == 2, run.stderr[-3000:]
        line = _one_line(run.stderr)
        assert "No space left on device" in line and str(mnt / "j") in line, line
        assert "free space there, or give a --job-dir on another disk" in line, line
