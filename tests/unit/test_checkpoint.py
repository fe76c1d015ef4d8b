"""Unit tests for cfrun.codec.checkpoint: write, commit, verify, load, retention, fallback."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cfrun.codec.checkpoint import (
    MANIFEST,
    apply_retention,
    commit,
    committed_steps,
    load_newest,
    load_shard,
    read_manifest,
    remove_staging,
    shard_names,
    staging_dir,
    verify,
    write_shard,
)
from cfrun.codec.format import FORMAT_VERSION, encode
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3, dtype=torch.bfloat16),
                  "count": torch.tensor(step, dtype=torch.int64)},
        "opt": {"state": {0: {"step": step}}, "lr": 0.1 * step, "betas": (0.9, 0.99)},
        "rng": np.arange(3, dtype=np.uint32) + step,
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0),
    }


def _save(checkpoints: Path, step: int, *, keep: int = 10, ranks: int = 1,
          state: dict[str, Any] | None = None, final: bool = False) -> Path:
    files = []
    for rank in range(ranks):
        tensors: list[torch.Tensor] = []
        tree = encode(state if state is not None else _state(step + rank), tensors)
        files += write_shard(staging_dir(checkpoints, step), rank, tree, tensors,
                             {"step": step, "rank": rank})
    meta: dict[str, Any] = {"step": step, **({"final": True} if final else {})}
    return commit(checkpoints, step, files, world_size=ranks, meta=meta, keep=keep)


def _assert_state_equal(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_state_equal(x, y)
    else:
        assert a == b


def _flip_byte(path: Path, index: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[index] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    p = tmp_path / "checkpoints"
    p.mkdir()
    return p


def test_write_and_commit_layout(ckpts: Path) -> None:
    final = _save(ckpts, 10)
    assert final == ckpts / "step-000010"
    assert final.is_dir()
    names = sorted(p.name for p in final.iterdir())
    assert names == sorted([MANIFEST, *shard_names(0)])
    assert not staging_dir(ckpts, 10).exists()
    manifest = json.loads((final / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["step"] == 10
    assert manifest["world_size"] == 1
    assert manifest["meta"] == {"step": 10}
    listed = {f["name"]: f for f in manifest["files"]}
    assert set(listed) == set(shard_names(0))
    for name, f in listed.items():
        assert (final / name).stat().st_size == f["nbytes"]
    # the .bin holds the tensors at aligned offsets
    assert (final / "rank-00000.bin").stat().st_size % 64 == 0
    assert verify(final) == read_manifest(final)
    # no temp files left behind by the manifest write
    assert not [p for p in final.iterdir() if ".tmp" in p.name]


def test_write_shard_returns_file_entries(ckpts: Path) -> None:
    tensors: list[torch.Tensor] = []
    tree = encode(_state(1), tensors)
    staging = staging_dir(ckpts, 1)
    files = write_shard(staging, 0, tree, tensors, {"x": 1})
    assert [f.name for f in files] == list(shard_names(0))
    for f in files:
        assert (staging / f.name).stat().st_size == f.nbytes
        assert len(f.xxh3_64) == 16
    # files are created with O_EXCL: writing the same shard twice is refused
    with pytest.raises(FileExistsError):
        write_shard(staging, 0, tree, tensors, {"x": 1})


def test_committed_steps_newest_first(ckpts: Path) -> None:
    assert committed_steps(ckpts) == []
    assert committed_steps(ckpts / "missing") == []
    for step in (5, 120, 30):
        _save(ckpts, step)
    assert committed_steps(ckpts) == [120, 30, 5]
    (ckpts / "step-bogus").mkdir()
    (ckpts / "step-bogus" / MANIFEST).write_text("{}")
    (ckpts / "step-000999").mkdir()  # no manifest: not committed
    assert committed_steps(ckpts) == [120, 30, 5]


def test_load_shard_round_trip(ckpts: Path) -> None:
    state = _state(7)
    final = _save(ckpts, 7, state=state)
    loaded, meta = load_shard(final, 0)
    _assert_state_equal(state, loaded)
    assert meta == {"step": 7, "rank": 0}
    assert loaded["model"]["b"].dtype == torch.bfloat16
    assert isinstance(loaded["opt"]["betas"], tuple)
    assert set(loaded["opt"]["state"]) == {0}


def test_multi_rank_shards(ckpts: Path) -> None:
    final = _save(ckpts, 3, ranks=2)
    manifest = read_manifest(final)
    assert manifest.world_size == 2
    assert len(manifest.files) == 4
    for rank in range(2):
        loaded, meta = load_shard(final, rank)
        _assert_state_equal(_state(3 + rank), loaded)
        assert meta["rank"] == rank
    with pytest.raises(CheckpointCorruptError):
        load_shard(final, 2)  # not in the manifest


def test_staging_without_manifest_is_ignored_and_removed(ckpts: Path) -> None:
    _save(ckpts, 10)
    tensors: list[torch.Tensor] = []
    staging = staging_dir(ckpts, 20)
    write_shard(staging, 0, encode(_state(20), tensors), tensors, {})
    assert staging.is_dir()
    assert committed_steps(ckpts) == [10]
    assert load_newest(ckpts, 0)[0] == 10  # type: ignore[index]
    assert remove_staging(ckpts) == 1
    assert not staging.exists()
    assert (ckpts / "step-000010").is_dir()  # committed ones untouched
    assert remove_staging(ckpts) == 0
    assert remove_staging(ckpts / "missing") == 0


def test_retention_keeps_newest(ckpts: Path) -> None:
    for step in (10, 20, 30, 40):
        _save(ckpts, step, keep=2)
    assert committed_steps(ckpts) == [40, 30]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000030", "step-000040"]


def test_apply_retention_returns_deleted(ckpts: Path) -> None:
    for step in (1, 2, 3):
        _save(ckpts, step)
    assert apply_retention(ckpts, 1) == [2, 1]
    assert committed_steps(ckpts) == [3]


def test_flipped_byte_detected_and_fallback(ckpts: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(ckpts, 10)
    _save(ckpts, 20)
    newest = ckpts / "step-000020"
    _flip_byte(newest / "rank-00000.bin", 5)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        load_shard(newest, 0)
    with pytest.raises(CheckpointCorruptError):
        verify(newest)
    with caplog.at_level(logging.WARNING, logger="cfrun.codec.checkpoint"):
        got = load_newest(ckpts, 0)
    assert got is not None
    step, state, meta = got
    assert step == 10
    assert meta["step"] == 10
    _assert_state_equal(_state(10), state)
    assert "step-000020" in caplog.text


def test_corrupt_json_shard_detected(ckpts: Path) -> None:
    final = _save(ckpts, 10)
    _flip_byte(final / "rank-00000.json", 0)
    with pytest.raises(CheckpointCorruptError):
        load_shard(final, 0)


def test_a_resume_never_starts_from_the_final_checkpoint(ckpts: Path) -> None:
    """Issue 27, item 2: the checkpoint taken at the script's end (``meta.final``) holds no
    loop position; a resume (``--rerun``) takes the newest one before it. It stays committed
    and newest for ``cfrun export``."""
    _save(ckpts, 10)
    _save(ckpts, 13, final=True)
    assert committed_steps(ckpts)[0] == 13 and read_manifest(ckpts / "step-000013").meta["final"]
    got = load_newest(ckpts, 0)
    assert got is not None and got[0] == 10
    assert committed_steps(ckpts)[0] == 13  # not moved aside


def test_load_newest_none_when_all_corrupt(ckpts: Path) -> None:
    assert load_newest(ckpts, 0) is None
    for step in (10, 20):
        _save(ckpts, step)
        _flip_byte(ckpts / f"step-{step:06d}" / "rank-00000.bin")
    assert load_newest(ckpts, 0) is None


def test_truncated_file_detected(ckpts: Path) -> None:
    final = _save(ckpts, 10)
    path = final / "rank-00000.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(CheckpointCorruptError, match="bytes"):
        load_shard(final, 0)


def test_missing_file_detected(ckpts: Path) -> None:
    final = _save(ckpts, 10)
    (final / "rank-00000.bin").unlink()
    with pytest.raises(CheckpointCorruptError):
        load_shard(final, 0)


def test_incompatible_format_version(ckpts: Path) -> None:
    _save(ckpts, 10)
    final = _save(ckpts, 20)
    manifest = json.loads((final / MANIFEST).read_text())
    manifest["format_version"] = 999
    (final / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleFormatError, match="999"):
        read_manifest(final)
    with pytest.raises(IncompatibleFormatError):
        load_shard(final, 0)
    got = load_newest(ckpts, 0)
    assert got is not None and got[0] == 10


@pytest.mark.parametrize("text", ["", "{not json", "[]", '{"format_version": 1}'])
def test_malformed_manifest(ckpts: Path, text: str) -> None:
    final = _save(ckpts, 10)
    (final / MANIFEST).write_text(text)
    with pytest.raises(CheckpointCorruptError):
        read_manifest(final)
    assert load_newest(ckpts, 0) is None


def test_commit_same_step_twice_keeps_first(ckpts: Path) -> None:
    first = _state(1)
    second = _state(2)
    _save(ckpts, 10, state=first)
    manifest_before = (ckpts / "step-000010" / MANIFEST).read_bytes()
    again = _save(ckpts, 10, state=second)
    assert again == ckpts / "step-000010"
    assert not staging_dir(ckpts, 10).exists()
    assert (ckpts / "step-000010" / MANIFEST).read_bytes() == manifest_before
    loaded, _ = load_shard(again, 0)
    _assert_state_equal(first, loaded)
    assert committed_steps(ckpts) == [10]


def test_new_commit_survives_retention_after_fallback(ckpts: Path) -> None:
    _save(ckpts, 20, keep=1)
    _flip_byte(ckpts / "step-000020" / "rank-00000.bin")
    assert load_newest(ckpts, 0) is None  # the job restarts from scratch...
    _save(ckpts, 10, keep=1)  # ...and commits its first new checkpoint
    got = load_newest(ckpts, 0)
    assert got is not None and got[0] == 10


def test_recommit_replaces_corrupt_step(ckpts: Path) -> None:
    _save(ckpts, 10, keep=3)
    _save(ckpts, 20, keep=3)
    _flip_byte(ckpts / "step-000020" / "rank-00000.bin")
    assert load_newest(ckpts, 0)[0] == 10  # type: ignore[index]
    _save(ckpts, 20, keep=3)  # the resumed job reaches step 20 again
    got = load_newest(ckpts, 0)
    assert got is not None and got[0] == 20
