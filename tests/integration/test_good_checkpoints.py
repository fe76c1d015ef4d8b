"""A checkpoint is *good* when it verifies and fits this job (issue 13, items 1 to 3).

Real ``cfrun`` runs on real job dirs:

* retention counts only good checkpoints and never deletes the newest good one, whatever
  higher-numbered steps of another ``format_version`` lie beside them;
* a checkpoint that fails while being read, decoded or applied (whatever the error's type) is
  moved aside with its reason, every rank falls back to the same previous good one, the run ends
  bit-identical to an uninterrupted one, and no later resume sees the bad one again;
* a checkpoint that does not fit the live job (a changed layer width, another parameter
  grouping, another scheduler) stops the job with exit 5 and one line naming the first
  difference, and leaves every checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from conftest import (
    SCRIPTS,
    assert_bit_identical,
    clean_env,
    ddp_reference,
    final_line,
    resumable_steps,
    run_cfrun,
    signed_manifest,
    slow_but,
    tiny_reference,
)

from cfrun.contract.checkpoints import MANIFEST, committed_steps, good_steps, verify
from cfrun.contract.jobdir import step_dir_name
from cfrun.contract.manifest import FileEntry, Manifest, read_manifest

# one xdist worker runs the module, so its module-scoped run is made once, not once per
# worker (issue 27, item 9)
pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("good_checkpoints")]

TINY = [str(SCRIPTS / "train_tiny.py"), "--epochs", "4", "--out", "got.pt"]


def _events(job: Path, kind: str) -> list[dict[str, Any]]:
    path = job / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == kind]


def _listing(ckpts: Path) -> list[tuple[str, int]]:
    """Every file under ``checkpoints/`` with its size, sorted."""
    return sorted((str(p.relative_to(ckpts)), p.stat().st_size) for p in ckpts.rglob("*")
                  if p.is_file())


def _plant_foreign(ckpts: Path, step: int, source: Path | None = None) -> Path:
    """A committed step written in ``format_version`` 2 (a newer cfrun): a copy of ``source``
    with its manifest's version changed, or a manifest alone."""
    dst = ckpts / step_dir_name(step)
    if source is not None:
        shutil.copytree(source, dst)
        manifest = json.loads((dst / MANIFEST).read_text())
        os.chmod(dst / MANIFEST, 0o600)
    else:
        dst.mkdir()
        manifest = {"step": step, "world_size": 1, "files": []}
    manifest["format_version"] = 2
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


def _crash_job(cwd: Path, crash_at: int = 58) -> Path:
    """train_tiny.py killed at step ``crash_at`` with no restart left: its two newest
    checkpoints are kept (40 and 50, or 41 and 51 when a persist was still busy at the
    interval: at most one checkpoint is in flight; :func:`_two_newest`)."""
    run = run_cfrun(["--interval", "10", "--max-restarts", "0", "--job-dir", "j",
                     "--inject-crash", str(crash_at), *TINY], cwd=cwd)
    assert run.returncode == 4, run.stderr[-3000:]
    return cwd / "j"


def _two_newest(job: Path) -> tuple[int, int]:
    """The crashed job's newest committed step and the one before it (which steps they are
    depends on how busy the machine was: a checkpoint due while one persists is deferred;
    issue 36: 24 and 47 on a loaded machine)."""
    steps = committed_steps(job / "checkpoints")
    assert len(steps) == 2 and 10 <= steps[1] < steps[0] <= 58, steps
    return steps[0], steps[1]


# ---------------------------------------------------------------------- 1. retention


@pytest.mark.slow
def test_foreign_higher_steps_neither_count_nor_cost_the_resumed_step(tiny_ref, tmp_path):
    """Scenario "Retention deletes the good ones": two higher-numbered steps of another
    format_version, then `cfrun resume`. The run resumes from the good step, the foreign ones
    are moved aside as incompatible, and retention keeps the newest good commits."""
    ref_run, ref_state = tiny_ref
    job = _crash_job(tmp_path)
    ckpts = job / "checkpoints"
    newest, _ = _two_newest(job)
    for step in (900, 901):
        _plant_foreign(ckpts, step, ckpts / step_dir_name(newest))
    again = run_cfrun(["resume", "j"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [e["step"] for e in _events(job, "resumed")] == [newest]
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(again.stdout) == final_line(ref_run.stdout)
    commits = [e["step"] for e in _events(job, "commit")]
    kept = committed_steps(ckpts)
    assert kept == good_steps(ckpts) == sorted(set(commits), reverse=True)[:2], (kept, commits)
    for step in kept:
        verify(ckpts / step_dir_name(step))
    moved = sorted(p.name.rsplit("-", 1)[0] for p in ckpts.iterdir()
                   if p.name.startswith("incompatible-"))
    assert moved == ["incompatible-step-000900", "incompatible-step-000901"]
    ls = run_cfrun(["ls", "j"], cwd=tmp_path)
    assert ls.returncode == 0 and "000900" not in ls.stdout and "900 " not in ls.stdout, ls.stdout


@pytest.mark.slow
def test_retention_during_a_run_ignores_foreign_steps_and_keeps_new_commits(tmp_path):
    """Foreign-format steps appear while the job runs (no resume moves them aside): every new
    commit used to be deleted at once; now the newest two good ones stay and the foreign ones
    are left alone."""
    stop = tmp_path / "stop"
    env = clean_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--keep", "2", "--job-dir", "j",
         str(SCRIPTS / "train_until_file.py"), str(stop), "20", "out.pt"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job = tmp_path / "j"
    try:
        deadline = time.monotonic() + 240
        while not _events(job, "commit"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.1)
        for step in (900_000, 900_001):
            _plant_foreign(job / "checkpoints", step)
        planted = len(_events(job, "commit"))
        while len(_events(job, "commit")) < planted + 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.1)
        stop.touch()
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    ckpts = job / "checkpoints"
    commits = sorted({e["step"] for e in _events(job, "commit")}, reverse=True)
    assert good_steps(ckpts) == commits[:2], (good_steps(ckpts), commits)
    assert committed_steps(ckpts)[:2] == [900_001, 900_000]  # not good, not counted, not deleted


# ---------------------------------------------------------------------- 2. bad checkpoints


def _reseal(step_dir: Path) -> None:
    """Rewrite the manifest so every file's size and checksum match again (what a crafted
    checkpoint needs to get past the checksum)."""
    old = read_manifest(step_dir)
    files = []
    for f in old.files:
        data = (step_dir / f.name).read_bytes()
        files.append(FileEntry(f.name, len(data), xxhash.xxh3_64_hexdigest(data)))
    os.chmod(step_dir / MANIFEST, 0o600)
    (step_dir / MANIFEST).write_bytes(signed_manifest(step_dir, Manifest.build(
        old.step, old.world_size, files, old.meta, committed_unix_s=old.committed_unix_s)))


def _edit_doc(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = step_dir / "rank-00000.json"
    doc = json.loads(path.read_bytes())
    edit(doc)
    os.chmod(path, 0o600)
    path.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    _reseal(step_dir)


def _truncate_bin(step_dir: Path) -> None:
    path = step_dir / "rank-00000.bin"
    data = path.read_bytes()
    os.chmod(path, 0o600)
    path.write_bytes(data[:len(data) // 2])
    _reseal(step_dir)


def _flip_own_bin(step_dir: Path) -> None:
    """One byte of the rank's own ``.bin`` flipped, the manifest left as it was: only the
    rank's background read of its shard checksums that file (issue 23, item 5)."""
    path = step_dir / "rank-00000.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))


def _drop_data(doc: dict[str, Any]) -> None:
    del doc["tree"]["data"]  # a KeyError where the resume looks up the loader position


def _bad_tensor_index(doc: dict[str, Any]) -> None:
    doc["tree"]["rng"]["torch"]["__t__"] = 10**6  # an IndexError while decoding


def _rng_as_int8(doc: dict[str, Any]) -> None:
    i = doc["tree"]["rng"]["torch"]["__t__"]
    doc["tensors"][i]["dtype"] = "int8"  # same bytes; torch.set_rng_state raises RuntimeError


def _short_random_state(doc: dict[str, Any]) -> None:
    # decodes and has every key: random.setstate raises ValueError only while applying
    doc["tree"]["rng"]["random"]["__tuple__"][1]["__tuple__"] = [1, 2, 3]


BAD = {
    "truncated .bin, manifest fixed up": lambda d: _truncate_bin(d),
    "checksum of its own .bin, found by the background read": lambda d: _flip_own_bin(d),
    "KeyError: no loader position": lambda d: _edit_doc(d, _drop_data),
    "IndexError: tensor reference": lambda d: _edit_doc(d, _bad_tensor_index),
    "RuntimeError: RNG state dtype": lambda d: _edit_doc(d, _rng_as_int8),
    "ValueError while applying": lambda d: _edit_doc(d, _short_random_state),
}


@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory: pytest.TempPathFactory):
    return tiny_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One crashed job (its two newest checkpoints kept, 40 and 50 on an idle machine), copied
    by each test."""
    return _crash_job(tmp_path_factory.mktemp("crashed"))


def _copy_job(src: Path, cwd: Path, name: str = "j", **config: Any) -> Path:
    """A copy of job dir ``src`` as ``cwd/name`` whose recorded working directory is ``cwd``
    (the resumed script writes its output there), with ``config`` changed."""
    job = cwd / name
    shutil.copytree(src, job, symlinks=True)
    recorded = json.loads((job / "config.json").read_text())
    (job / "config.json").write_text(json.dumps({**recorded, "cwd": str(cwd), **config}))
    return job


@pytest.mark.parametrize("case", slow_but(BAD, "KeyError: no loader position"))
def test_a_bad_checkpoint_is_moved_aside_and_every_rank_falls_back(tiny_ref, crashed, tmp_path,
                                                                   case):
    """Scenario "A bad checkpoint blocks every later resume", for each kind of failure."""
    ref_run, ref_state = tiny_ref
    job = _copy_job(crashed, tmp_path, max_restarts=2)
    ckpts = job / "checkpoints"
    newest, previous = _two_newest(job)
    BAD[case](ckpts / step_dir_name(newest))
    again = run_cfrun(["resume", "j"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "UNPROTECTED" not in again.stderr, again.stderr[-3000:]
    assert [e["step"] for e in _events(job, "checkpoint_corrupt")] == [newest]  # said once
    assert _events(job, "resumed")[-1]["step"] == previous
    assert not _events(job, "unprotected")
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(again.stdout) == final_line(ref_run.stdout)
    warnings = [l for l in again.stderr.splitlines() if f"checkpoint step {newest}" in l
                and "WARNING" in l]
    assert len(warnings) == 1 and "moved aside" in warnings[0], again.stderr[-3000:]
    moved = [p for p in ckpts.iterdir() if p.name.startswith(f"corrupt-{step_dir_name(newest)}-")]
    assert len(moved) == 1 and (moved[0] / MANIFEST).exists()
    for step in committed_steps(ckpts):  # what a later resume would look at: all good
        verify(ckpts / step_dir_name(step))
    ls = run_cfrun(["ls", "j"], cwd=tmp_path)
    assert ls.returncode == 0 and "corrupt" not in ls.stdout, ls.stdout + ls.stderr


def test_a_checksum_failure_in_one_ranks_shard_moves_both_ranks_back(tmp_path, tmp_path_factory):
    """Only rank 1's shard of the newest checkpoint is damaged (same size): rank 0 alone could
    load the step, rank 1 cannot. Both ranks resume from the same previous step and the job
    ends bit-identical."""
    shared, first = ddp_reference(tmp_path_factory)
    _copy_job(shared.job_dir, tmp_path, "ref")
    ckpts = tmp_path / "ref" / "checkpoints"
    newest, previous = resumable_steps(ckpts)[:2]  # not the final one, never resumed from
    shard = ckpts / step_dir_name(newest) / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(data))
    again = run_cfrun(["resume", "--rerun", "ref"], cwd=tmp_path)  # a finished job
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = _events(tmp_path / "ref", "resumed")
    assert sorted(e["rank"] for e in resumed) == [0, 1]
    assert {e["step"] for e in resumed} == {previous}
    assert [e["step"] for e in _events(tmp_path / "ref", "checkpoint_corrupt")] == [newest]
    assert_bit_identical(first, torch.load(tmp_path / "ref.pt", weights_only=True))
    assert any(p.name.startswith(f"corrupt-step-{newest:06d}-") for p in ckpts.iterdir())


# ---------------------------------------------------------------------- 3. a changed job

WIDTH = [str(SCRIPTS / "train_width.py"), "4", "got.pt"]


@pytest.mark.parametrize("change, needles", [
    ({"WIDTH": "32"}, ["model 0", "0.weight", "[16, 8]", "[32, 8]"]),
    pytest.param({"GROUPS": "2"}, ["optimizer 0", "1 parameter groups in the checkpoint, 2 live"],
                 marks=pytest.mark.extended),  # the refusal's path: the model's case
    pytest.param({"SCHED": "exp"}, ["LR scheduler 0 (ExponentialLR)",
                                    "step_size only in the checkpoint"],
                 marks=pytest.mark.extended),
])
@pytest.mark.slow
def test_a_changed_model_stops_with_exit_5_and_touches_nothing(tmp_path, change, needles):
    """Scenario "A changed model half-restores": the checkpoint is fine, the job changed."""
    first = run_cfrun(["--interval", "5", "--max-restarts", "0", "--job-dir", "j",
                       "--inject-crash", "20", *WIDTH], cwd=tmp_path)
    assert first.returncode == 4, first.stderr[-3000:]
    ckpts = tmp_path / "j" / "checkpoints"
    before = _listing(ckpts)
    assert committed_steps(ckpts)
    changed = run_cfrun(["resume", "j"], cwd=tmp_path, env=change)
    assert changed.returncode == 5, changed.stderr[-3000:]
    [line] = [l for l in changed.stderr.splitlines() if l.startswith("cfrun: error:")]
    for needle in [*needles, "does not fit this job", "--job-dir"]:
        assert needle in line, line
    assert _listing(ckpts) == before  # nothing moved aside, deleted or written
    assert not _events(tmp_path / "j", "resumed")
    same = run_cfrun(["resume", "j"], cwd=tmp_path)  # the old job goes on as before
    assert same.returncode == 0, same.stderr[-3000:]
    assert _events(tmp_path / "j", "resumed")
