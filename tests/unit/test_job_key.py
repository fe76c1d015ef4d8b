"""The job's own secret (cfrun/contract/jobkey.py): made once, private, never through a link,
and a given key must be the job dir's (issue 24, item 2)."""

from __future__ import annotations

import os
import stat

import pytest

from cfrun.contract.errors import BadInputError
from cfrun.contract.jobkey import JOB_KEY_FILE, ensure_job_key, read_key_file


def test_made_once_private_and_kept(tmp_path):
    key = ensure_job_key(tmp_path)
    path = tmp_path / JOB_KEY_FILE
    assert len(key) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_job_key(tmp_path) == key  # a restart, another node: the same key
    other = tmp_path / "other"
    other.mkdir()
    assert ensure_job_key(other) != key  # a new job dir: a new random key


def test_a_given_key_is_taken_by_a_new_job_dir_and_must_match_an_old_one(tmp_path):
    given = tmp_path / "k"
    given.write_text("ab" * 32 + "\n")
    given.chmod(0o600)
    moved = tmp_path / "moved"
    moved.mkdir()
    assert ensure_job_key(moved, given) == b"ab" * 32  # a job moved to a new machine
    mine = tmp_path / "mine"
    mine.mkdir()
    ensure_job_key(mine)
    with pytest.raises(BadInputError, match="another job's key"):
        ensure_job_key(mine, given)


@pytest.mark.parametrize("case", ["link", "shared", "short", "not hex"])
def test_a_bad_key_file_is_one_line(tmp_path, case):
    target = tmp_path / "real"
    target.write_text("cd" * 32)
    target.chmod(0o600)
    path = tmp_path / "k"
    if case == "link":
        os.symlink(target, path)
    else:
        path.write_text({"shared": "cd" * 32, "short": "cd" * 8, "not hex": "zz" * 32}[case])
        path.chmod(0o644 if case == "shared" else 0o600)
    with pytest.raises(BadInputError) as e:
        read_key_file(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_planted_link_in_the_job_dir_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    job = tmp_path / "j"
    job.mkdir()
    os.symlink(victim, job / JOB_KEY_FILE)
    with pytest.raises(BadInputError):
        ensure_job_key(job)
    assert victim.read_text() == "precious"
