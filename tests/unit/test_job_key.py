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


# ---------------------------------------------------------------------- seal keys (issue 32)


def _seal(keys, step=3):
    """A one-rank manifest sealed under ``keys.seal`` and the SHA-256 the agent would see."""
    from cfrun.peer.protocol import job_seal_tag

    files = [{"name": "rank-00000.bin", "nbytes": 4, "sha256": "ab" * 32}]
    meta = {"job_id": "x"}
    tag = job_seal_tag(keys.seal, step=step, world_size=1, rank=0, files=files, meta=meta)
    manifest = {"step": step, "world_size": 1, "meta": meta,
                "files": [{"name": "rank-00000.bin", "nbytes": 4}],
                "seals": [{"rank": 0, "tag": "0" * 64, "job_tag": tag}]}
    return manifest, {"rank-00000.bin": "ab" * 32}


def test_with_a_peer_the_seal_key_survives_the_node_with_the_token_alone(tmp_path):
    """Two job dirs (the lost node's, the new machine's: empty, no job.key), the same token and
    job name: the same seal key, and nothing is written into the new job dir. Another token or
    another job name seals under another key, refused with one line naming the token."""
    from cfrun.agent.peerpath import job_seal_keys
    from cfrun.contract.errors import CheckpointCorruptError
    from cfrun.peer.protocol import verify_job_seals

    token = b"t" * 32
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    mine = job_seal_keys(old, "job-1", token=token)
    manifest, sha = _seal(mine)
    fresh = job_seal_keys(new, "job-1", token=token)
    assert fresh.seal == mine.seal
    verify_job_seals(fresh, manifest, 3, job="job-1", sha256=sha)
    assert not (new / JOB_KEY_FILE).exists() and not (old / JOB_KEY_FILE).exists()
    for keys in (job_seal_keys(new, "job-1", token=b"u" * 32),
                 job_seal_keys(new, "job-2", token=token)):
        with pytest.raises(CheckpointCorruptError, match="not sealed by this job") as e:
            verify_job_seals(keys, manifest, 3, job="job-1", sha256=sha)
        assert "--peer-token-file" in str(e.value) and "\n" not in str(e.value)


def test_a_per_job_key_wins_and_refuses_what_the_token_sealed(tmp_path):
    """--job-key-file (the supervisor copies it into job.key; the agent gets --per-job-key):
    seals under that key only; a checkpoint sealed under the token (by any holder of it) is
    refused, and a token-sealed job refuses the per-job key's."""
    from cfrun.agent.peerpath import job_seal_keys
    from cfrun.contract.errors import CheckpointCorruptError
    from cfrun.peer.protocol import verify_job_seals

    token = b"t" * 32
    given = tmp_path / "k"
    given.write_text("ab" * 32 + "\n")
    given.chmod(0o600)
    job = tmp_path / "j"
    job.mkdir()
    ensure_job_key(job, given)
    per_job = job_seal_keys(job, "job-1", token=token, per_job_key=True)
    assert per_job.accept == (per_job.seal,)
    by_token, sha = _seal(job_seal_keys(tmp_path, "job-1", token=token))
    with pytest.raises(CheckpointCorruptError, match="--job-key-file"):
        verify_job_seals(per_job, by_token, 3, job="job-1", sha256=sha)
    by_key, sha = _seal(per_job)
    verify_job_seals(per_job, by_key, 3, job="job-1", sha256=sha)
    elsewhere = tmp_path / "e"
    elsewhere.mkdir()
    with pytest.raises(CheckpointCorruptError):
        verify_job_seals(job_seal_keys(elsewhere, "job-1", token=token), by_key, 3,
                         job="job-1", sha256=sha)


def test_an_older_cfrun_s_job_key_seals_are_installed_only_where_that_key_is(tmp_path):
    """A job dir with the job.key an older cfrun made: its checkpoints (sealed under it) are
    still installed there under the token's keys, and new ones are sealed under the token; on a
    machine without that job.key they are refused."""
    from cfrun.agent.peerpath import job_seal_keys
    from cfrun.contract.errors import CheckpointCorruptError
    from cfrun.peer.protocol import SealKeys, token_seal_key, verify_job_seals

    token = b"t" * 32
    job = tmp_path / "j"
    job.mkdir()
    old_key = ensure_job_key(job)
    old_sealed, sha = _seal(SealKeys.of_job_key(old_key, "job-1"))
    here = job_seal_keys(job, "job-1", token=token)
    assert here.seal == token_seal_key(token, "job-1") and len(here.accept) == 2
    verify_job_seals(here, old_sealed, 3, job="job-1", sha256=sha)
    new = tmp_path / "new"
    new.mkdir()
    with pytest.raises(CheckpointCorruptError):
        verify_job_seals(job_seal_keys(new, "job-1", token=token), old_sealed, 3, job="job-1",
                         sha256=sha)
    os.unlink(job / JOB_KEY_FILE)
    os.symlink(tmp_path / "nowhere", job / JOB_KEY_FILE)
    with pytest.raises(BadInputError, match="the job key"):
        job_seal_keys(job, "job-1", token=token)  # a planted link is refused, not followed
