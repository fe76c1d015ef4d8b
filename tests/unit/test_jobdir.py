"""Unit tests for cfrun.contract.jobdir: atomic JSON writes, usability checks, the lock, events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cfrun.contract.errors import EXIT_LOCKED, BadInputError, JobDirLockedError
from cfrun.contract.jobdir import JobDir, atomic_write_json, step_dir_name


def test_atomic_write_json_round_trip_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    atomic_write_json(path, {"b": [1, 2], "a": {"x": None}})
    assert json.loads(path.read_text()) == {"b": [1, 2], "a": {"x": None}}
    atomic_write_json(path, [1, "two"])  # replaces
    assert json.loads(path.read_text()) == [1, "two"]
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_atomic_write_json_failure_keeps_old_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    atomic_write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}


def test_step_dir_name_sorts() -> None:
    assert step_dir_name(120) == "step-000120"
    names = [step_dir_name(s) for s in (5, 40, 300, 1000)]
    assert names == sorted(names)


def test_paths(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    assert jd.root.is_absolute()
    assert jd.config_path == jd.root / "config.json"
    assert jd.events_path == jd.root / "events.jsonl"
    assert jd.checkpoints == jd.root / "checkpoints"
    assert jd.lock_path == jd.root / "job.lock"
    jd.create()
    jd.create()  # idempotent
    assert jd.checkpoints.is_dir()


def test_check_usable_file(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(BadInputError, match="is a file"):
        JobDir(f).check_usable()


def test_check_usable_foreign_dir(tmp_path: Path) -> None:
    d = tmp_path / "foreign"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(BadInputError) as info:
        JobDir(d).check_usable()
    assert str(d) in str(info.value)
    assert (d / "notes.txt").read_text() == "mine"  # untouched


def test_check_usable_accepts_new_empty_and_existing_job(tmp_path: Path) -> None:
    JobDir(tmp_path / "new" / "nested").check_usable()
    empty = tmp_path / "empty"
    empty.mkdir()
    JobDir(empty).check_usable()
    job = tmp_path / "job"
    job.mkdir()
    (job / "config.json").write_text("{}")
    (job / "events.jsonl").write_text("")
    JobDir(job).check_usable()


def test_lock_seen_by_second_object(tmp_path: Path) -> None:
    a = JobDir(tmp_path)
    b = JobDir(tmp_path)
    assert not b.is_locked()
    a.lock()
    try:
        assert b.is_locked()
        assert a.is_locked()
        with pytest.raises(JobDirLockedError) as info:
            b.lock()
        assert info.value.exit_code == EXIT_LOCKED
    finally:
        a.unlock()
    assert not b.is_locked()
    b.lock()  # free again
    assert a.is_locked()
    b.unlock()
    b.unlock()  # no-op when not held
    assert not a.is_locked()


def test_lock_blocks_other_process(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys
        from cfrun.contract.errors import JobDirLockedError
        from cfrun.contract.jobdir import JobDir
        try:
            JobDir({str(tmp_path)!r}).lock()
        except JobDirLockedError:
            sys.exit(3)
        sys.exit(0)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    jd = JobDir(tmp_path)
    jd.lock()
    try:
        held = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)
        assert held.returncode == 3, held.stderr
    finally:
        jd.unlock()
    free = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert free.returncode == 0, free.stderr


def test_events_round_trip(tmp_path: Path) -> None:
    jd = JobDir(tmp_path)
    assert jd.read_events() == []
    jd.emit_event("attempt_start", attempt=0, argv=[])
    jd.emit_event("checkpoint", attempt=0, mode="snapshot", persist="agent", step=10, bytes=1,
                  path=tmp_path)  # an open kind; a non-JSON value -> str
    events = jd.read_events()
    assert [e["event"] for e in events] == ["attempt_start", "checkpoint"]
    assert events[0]["attempt"] == 0
    assert events[1]["step"] == 10
    assert events[1]["path"] == str(tmp_path)
    assert all(isinstance(e["t_unix_s"], float) for e in events)
    assert len(jd.events_path.read_text().splitlines()) == 2


def test_read_events_skips_torn_last_line(tmp_path: Path) -> None:
    jd = JobDir(tmp_path)
    jd.emit_event("agent_start", pid=1)
    jd.emit_event("agent_start", pid=2)
    with open(jd.events_path, "a") as f:
        f.write('{"event": "c", "n"')  # crash mid-append
    events = jd.read_events()
    assert [e["pid"] for e in events] == [1, 2]


def test_event_after_torn_line_is_kept(tmp_path: Path) -> None:
    jd = JobDir(tmp_path)
    jd.emit_event("agent_start", pid=1)
    with open(jd.events_path, "a") as f:
        f.write('{"event": "c", "n"')  # crash mid-append
    jd.emit_event("hang", attempt=0, hang_timeout_s=10)
    assert [e["event"] for e in jd.read_events()] == ["agent_start", "hang"]


# ---------------------------------------------------------------- private modes, no links

def _mode(path: Path) -> int:
    import stat

    return stat.S_IMODE(os.lstat(path).st_mode)


def test_job_dir_and_its_files_are_private(tmp_path: Path) -> None:
    """The job dir and checkpoints/ 0700 (an existing 0755 one is tightened), the lock and
    the events 0600, whatever the umask."""
    old = os.umask(0o022)
    try:
        jd = JobDir(tmp_path / "job")
        jd.create()
        assert _mode(jd.root) == 0o700 and _mode(jd.checkpoints) == 0o700
        assert _mode(jd.root / "profiles") == 0o700
        jd.emit_event("attempt_start", attempt=0, argv=[])
        jd.lock()
        jd.unlock()
        assert _mode(jd.events_path) == 0o600 and _mode(jd.lock_path) == 0o600
        older = JobDir(tmp_path / "older")
        (older.root / "checkpoints").mkdir(parents=True, mode=0o755)
        older.root.chmod(0o755)
        older.create()
        assert _mode(older.root) == 0o700 and _mode(older.checkpoints) == 0o700
    finally:
        os.umask(old)


@pytest.mark.parametrize("name", ["events.jsonl", "job.lock"])
def test_no_write_into_the_job_dir_follows_a_link(tmp_path: Path, name: str) -> None:
    """A link planted where the events or the lock go is refused; its target is untouched."""
    jd = JobDir(tmp_path / "job")
    jd.create()
    target = tmp_path / "target.txt"
    target.write_text("precious")
    (jd.root / name).symlink_to(target)
    with pytest.raises(BadInputError, match="symbolic link"):
        if name == "job.lock":
            jd.lock()
        else:
            jd.emit_event("attempt_start", attempt=0, argv=[])
    if name == "job.lock":
        with pytest.raises(BadInputError, match="symbolic link"):
            jd.is_locked()
    assert target.read_text() == "precious"


def test_checkpoints_as_a_link_is_refused(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    jd.checkpoints.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadInputError, match="not a directory"):
        jd.create()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory of another uid")
def test_check_usable_refuses_a_directory_of_another_user(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 65534, 65534)
    with pytest.raises(BadInputError, match="belongs to uid 65534"):
        JobDir(d).check_usable()


def test_set_aside_checkpoints_moves_them_whole_to_a_named_sibling(tmp_path) -> None:
    """A finished job started over (issue 37, item 2): a rename, nothing deleted; a second
    one in the same second gets a name of its own."""
    from cfrun.contract.jobdir import PREVIOUS_CHECKPOINTS_PREFIX

    jd = JobDir(tmp_path / "j")
    jd.create()
    (jd.checkpoints / "step-000005").mkdir()
    (jd.checkpoints / "step-000005" / "manifest.json").write_text("{}")
    first = jd.set_aside_checkpoints()
    assert first.parent == jd.root and first.name.startswith(PREVIOUS_CHECKPOINTS_PREFIX)
    assert (first / "step-000005" / "manifest.json").read_text() == "{}"
    assert jd.checkpoints.is_dir() and not any(jd.checkpoints.iterdir())
    second = jd.set_aside_checkpoints()
    assert second != first and first.is_dir() and second.is_dir()
