"""Crafted checkpoints: metadata that passes its checksum but lies, and files that are not files.

Each checkpoint here has a manifest whose sizes and checksums match the (crafted) files, so only
the loader's own checks stand between it and the resume: each must be refused with a one-line
reason, quickly (no hang on a FIFO, no read of /dev/zero, no allocation a shape asks for), and
:func:`load_newest` must fall back to the older good checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from cfrun.codec.checkpoint import (
    MANIFEST,
    JobMismatchError,
    check_complete,
    check_like,
    commit,
    committed_steps,
    load_newest,
    load_shard,
    staging_dir,
    verify,
    write_shard,
)
from cfrun.codec.format import encode
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.fsio import UnsafeFileError, read_regular, write_atomic
from cfrun.contract.jobdir import step_dir_name
from cfrun.contract.manifest import FileEntry, Manifest, loads_bounded, read_manifest

pytestmark = pytest.mark.timeout(30)

GOOD, CRAFTED = 10, 20


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"modules": [{"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)}],
            "extra": {"lr": 0.1, "rng": torch.arange(5, dtype=torch.int64)}}


def _save(ckpts: Path, step: int) -> Path:
    tensors: list[torch.Tensor] = []
    tree = encode(_state(step), tensors)
    files = write_shard(staging_dir(ckpts, step), 0, tree, tensors, {"step": step})
    return commit(ckpts, step, files, world_size=1, meta={"step": step}, keep=None)


def _reseal(step_dir: Path) -> None:
    """Rewrite the manifest so every regular file's size and checksum match again."""
    old = read_manifest(step_dir)
    files = []
    for f in old.files:
        data = (step_dir / f.name).read_bytes()
        files.append(FileEntry(f.name, len(data), xxhash.xxh3_64_hexdigest(data)))
    (step_dir / MANIFEST).write_bytes(Manifest.build(old.step, old.world_size, files,
                                                     old.meta).dumps())


def _edit_doc(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = step_dir / "rank-00000.json"
    doc = json.loads(path.read_bytes())
    edit(doc)
    raw = json.dumps(doc).encode().replace(b'"DEEP"', b"[" * 5000 + b"]" * 5000)
    path.write_bytes(raw)
    _reseal(step_dir)


def _write_doc_bytes(step_dir: Path, raw: bytes) -> None:
    (step_dir / "rank-00000.json").write_bytes(raw)
    _reseal(step_dir)


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    d = tmp_path / "checkpoints"
    d.mkdir()
    _save(d, GOOD)
    _save(d, CRAFTED)
    return d


def _t(doc: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return doc["tensors"][i]


def _set(i: int, **kw: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: _t(doc, i).update(kw)


def _overlap(doc: dict[str, Any]) -> None:
    _t(doc, 1)["offset"] = 0


def _tree(tree: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["extra"]["x"] = tree
    return edit


def _deep(doc: dict[str, Any]) -> None:
    doc["tree"]["extra"]["x"] = "DEEP"  # replaced by 5,000 nested lists in the bytes


DOC_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "nbytes 0": (_set(0, nbytes=0), "nbytes 0 is not 48"),
    "nbytes too small": (_set(0, nbytes=4), "nbytes 4 is not 48"),
    "unknown dtype": (_set(0, dtype="object"), "dtype 'object' is not one cfrun stores"),
    "huge shape": (_set(0, shape=[1 << 30, 1 << 30], nbytes=4 << 60),
                   "ends at byte"),
    "negative shape": (_set(0, shape=[-4, -3], nbytes=48), "shape [-4, -3]"),
    "float shape": (_set(0, shape=[4.0, 3], nbytes=48), "shape [4.0, 3]"),
    "unaligned offset": (_set(1, offset=50), "offset 50"),
    "overlapping tensors": (_overlap, "tensor 1 at offset 0, the writer puts it at 64"),
    "offset past the end": (_set(2, offset=1 << 20), "at offset 1048576"),
    "extra table field": (_set(0, exec="rm -rf /"), "does not have exactly the fields"),
    "tensor index out of range": (_tree({"__t__": 7}), "tensor reference 7"),
    "negative tensor index": (_tree({"__t__": -1}), "tensor reference -1"),
    "numpy object dtype": (_tree({"__np__": "|O", "v": 1}), "numpy dtype '|O'"),
    "numpy huge shape": (_tree({"__nd__": "<f4", "shape": [1 << 20, 1 << 20], "data": []}),
                         "does not fill its shape"),
    "numpy void dtype": (_tree({"__nd__": "V99999999", "shape": [1], "data": [0]}),
                         "numpy dtype"),
    "bad dict pairs": (_tree({"__dict__": [[1]]}), "does not decode"),
    "deep tree": (_deep, "nested 5"),
    "no format version": (lambda doc: doc.pop("format_version"), "format_version"),
}


DECODE_ONLY = {"tensor index out of range", "negative tensor index", "numpy object dtype",
               "numpy huge shape", "numpy void dtype", "bad dict pairs"}


def _assert_refused_then_fallback(ckpts: Path, needle: str) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorruptError) as err:
        load_shard(step_dir, 0)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg and len(msg) < 400, msg
    skipped: list[tuple[int, str]] = []
    got = load_newest(ckpts, 0, on_skip=lambda s, e: skipped.append((s, str(e))))
    assert got is not None and got[0] == GOOD  # fell back to the good one
    assert torch.equal(got[1]["modules"][0]["w"], _state(GOOD)["modules"][0]["w"])
    assert [s for s, _ in skipped] == [CRAFTED] and "\n" not in skipped[0][1]
    assert committed_steps(ckpts) == [GOOD]  # the crafted one is quarantined, kept aside
    assert any(p.name.startswith(f"corrupt-{step_dir_name(CRAFTED)}") for p in ckpts.iterdir())
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("case", list(DOC_CASES))
def test_lying_shard_metadata_is_refused_and_resume_falls_back(ckpts: Path, case: str) -> None:
    edit, needle = DOC_CASES[case]
    _edit_doc(ckpts / step_dir_name(CRAFTED), edit)
    crafted = ckpts / step_dir_name(CRAFTED)
    read_manifest(crafted).verify_dir(crafted)  # the checksums pass: only the loader's checks
    if case in DECODE_ONLY:
        verify(crafted)  # the tree is judged when decoded, by the rank
    else:
        with pytest.raises(CheckpointCorruptError, match=re.escape(needle)):
            verify(crafted)  # what `cfrun ls` runs, without torch
    _assert_refused_then_fallback(ckpts, needle)


def test_huge_shape_in_88_bytes_of_json_allocates_nothing(ckpts: Path) -> None:
    """The report's case: one float32 tensor of 200 M elements, ``nbytes: 0``, in 88 bytes."""
    raw = (b'{"format_version":1,"tree":{"__t__":0},"tensors":[{"dtype":"float32",'
           b'"shape":[200000000],"offset":0,"nbytes":0,"device":"cpu"}]}')
    _write_doc_bytes(ckpts / step_dir_name(CRAFTED), raw)
    _assert_refused_then_fallback(ckpts, "nbytes 0 is not 800000000")


def test_oversized_shard_json_is_refused_before_reading(ckpts: Path) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    m = read_manifest(step_dir)
    files = [FileEntry(f.name, (1 << 40) if f.name.endswith(".json") else f.nbytes, f.xxh3_64)
             for f in m.files]
    (step_dir / MANIFEST).write_bytes(Manifest.build(m.step, 1, files, m.meta).dumps())
    _assert_refused_then_fallback(ckpts, "more than the")


def test_int32_over_float32_bytes_loads_but_check_like_refuses_it(ckpts: Path) -> None:
    """Same size, so neither checksum nor table can tell; the rank compares with the live
    model before ``load_state_dict`` (which would convert silently)."""
    step_dir = ckpts / step_dir_name(CRAFTED)
    _edit_doc(step_dir, _set(0, dtype="int32"))
    state, _ = load_shard(step_dir, 0)
    live = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    with pytest.raises(JobMismatchError, match=r"modules\[0\]\.w is int32 \[4, 3\] in the "
                                                     r"checkpoint, float32 \[4, 3\] live"):
        check_like(state["modules"][0], live, "modules[0]")
    good, _ = load_shard(ckpts / step_dir_name(GOOD), 0)
    check_like(good["modules"][0], live, "modules[0]")  # a true checkpoint passes


# ---------------------------------------------------------------------- manifests


def _manifest_json(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / MANIFEST).read_bytes())


MANIFEST_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "path traversal": (lambda m: m["files"].append(
        {"name": "../../etc/hostname", "nbytes": 10, "xxh3_64": "0" * 16}),
        "file name '../../etc/hostname' is not one a checkpoint has"),
    "absolute path": (lambda m: m["files"][0].update(name="/etc/passwd"),
                      "file name '/etc/passwd'"),
    "manifest as a file": (lambda m: m["files"][0].update(name="manifest.json"),
                           "file name 'manifest.json'"),
    "unknown field": (lambda m: m.update(loader="pickle"), "unknown field(s) 'loader'"),
    "unknown file field": (lambda m: m["files"][0].update(mode=0o777), "unknown field(s) 'mode'"),
    "negative size": (lambda m: m["files"][0].update(nbytes=-1), "nbytes -1"),
    "string size": (lambda m: m["files"][0].update(nbytes="48"), "nbytes '48'"),
    "bool world size": (lambda m: m.update(world_size=True), "world_size True"),
    "huge world size": (lambda m: m.update(world_size=10**9), "world_size 1000000000"),
    "duplicate file": (lambda m: m["files"].append(dict(m["files"][0])), "listed twice"),
    "bad checksum text": (lambda m: m["files"][0].update(xxh3_64="zz"), "xxh3_64 'zz'"),
    "no files": (lambda m: m.update(files=[]), "files must be a list"),
    "seal of a rank not in the job": (lambda m: m.update(seals=[{"rank": 1, "tag": "a" * 64}]),
                                      "seal: rank 1"),
    "seal tag not hex": (lambda m: m.update(seals=[{"rank": 0, "tag": "../x"}]),
                         "seal tag '../x'"),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_malformed_manifest_is_refused(ckpts: Path, case: str) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    m = _manifest_json(step_dir)
    edit, needle = MANIFEST_CASES[case]
    edit(m)
    (step_dir / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointCorruptError) as err:
        read_manifest(step_dir)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    _assert_refused_then_fallback(ckpts, needle)


@pytest.mark.parametrize("raw, needle", [
    (b'{"committed_unix_s": NaN}', "not a finite number"),
    (b'{"committed_unix_s": Infinity}', "not a finite number"),
    (b"[" * 100 + b"]" * 100, "nested 100 deep"),
    (b"\xff\xfe not utf-8", "unreadable manifest"),
])
def test_manifest_json_bounds(ckpts: Path, raw: bytes, needle: str) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    (step_dir / MANIFEST).write_bytes(raw)
    with pytest.raises(CheckpointCorruptError, match=needle.replace("(", r"\(")):
        read_manifest(step_dir)


def test_non_finite_meta_and_time_are_refused(ckpts: Path) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    m = _manifest_json(step_dir)
    (step_dir / MANIFEST).write_text(json.dumps(m).replace('"meta": {', '"meta": {"x": 1e999, '))
    with pytest.raises(CheckpointCorruptError, match="not finite"):
        read_manifest(step_dir)


def test_oversized_manifest_is_refused_before_reading(ckpts: Path) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    with open(step_dir / MANIFEST, "wb") as f:
        f.truncate(64 << 20)  # sparse: costs no disk
    with pytest.raises(CheckpointCorruptError, match="more than"):
        read_manifest(step_dir)


def test_incompatible_version_is_not_corrupt(ckpts: Path) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    m = _manifest_json(step_dir)
    m["format_version"] = 2
    (step_dir / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(IncompatibleFormatError, match="format_version 2"):
        read_manifest(step_dir)


def test_build_refuses_what_a_reader_would() -> None:
    with pytest.raises(ValueError, match="not one a checkpoint has"):
        Manifest.build(1, 1, [FileEntry("../x", 1, "0" * 16)])
    with pytest.raises(ValueError, match="committed_unix_s"):
        Manifest.build(1, 1, [FileEntry("rank-00000.bin", 1, "0" * 16)],
                       committed_unix_s=math.nan)
    m = Manifest.build(5, 2, [FileEntry("rank-00000.bin", 1, "0" * 16)], {"epoch": 1})
    assert Manifest.parse(m.dumps()) == m
    sealed = Manifest.build(5, 2, [FileEntry("rank-00000.bin", 1, "0" * 16)],
                            seals=[{"rank": 0, "tag": "ab" * 32}, {"rank": 1, "tag": "cd" * 32}])
    assert Manifest.parse(sealed.dumps()) == sealed and "seals" not in m.to_json()


# ---------------------------------------------------------------------- not regular files


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _replace_with_link(target: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.unlink()
        path.symlink_to(target)
    return make


@pytest.mark.parametrize("name", ["rank-00000.bin", "rank-00000.json", MANIFEST])
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "link to a file", "directory"])
def test_special_files_are_refused_without_reading(ckpts: Path, name: str, kind: str) -> None:
    step_dir = ckpts / step_dir_name(CRAFTED)
    path = step_dir / name
    if kind == "fifo":
        _replace_with_fifo(path)
    elif kind == "link to /dev/zero":
        _replace_with_link("/dev/zero")(path)
    elif kind == "link to a file":
        (ckpts.parent / "elsewhere").write_bytes(path.read_bytes())
        _replace_with_link(str(ckpts.parent / "elsewhere"))(path)
    else:
        path.unlink()
        path.mkdir()
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorruptError) as err:
        verify(step_dir)
    assert "\n" not in str(err.value)
    if name != MANIFEST:
        with pytest.raises(CheckpointCorruptError, match="not a regular file"):
            check_complete(step_dir)  # each rank checks this first: lstat only
    assert time.monotonic() - t0 < 5
    _assert_refused_then_fallback(ckpts, "")


def test_read_regular_refuses_devices_fifos_links_and_big_files(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to("/dev/zero")
    (tmp_path / "big").write_bytes(b"x" * 100)
    for path, needle in ((tmp_path / "fifo", "a FIFO"), ("/dev/zero", "a character device"),
                         (tmp_path / "link", "a symlink"), (tmp_path / "big", "100 bytes"),
                         (tmp_path, "a directory")):
        with pytest.raises(UnsafeFileError, match=needle):
            read_regular(path, max_bytes=10)
    assert read_regular(tmp_path / "big", max_bytes=100) == b"x" * 100


def test_loads_bounded_checks_depth_before_parsing() -> None:
    deep = b"[" * 200_000 + b"]" * 200_000  # the parser would recurse 200,000 deep
    with pytest.raises(ValueError, match="nested 200000 deep"):
        loads_bounded(deep, max_bytes=1 << 20, max_depth=100)
    brackets_in_strings = json.dumps({"s": "[[[[{{{{" * 1000, "a": [[1]]}).encode()
    assert loads_bounded(brackets_in_strings, max_bytes=1 << 20, max_depth=3)["a"] == [[1]]
    with pytest.raises(ValueError, match="bytes of JSON"):
        loads_bounded(b"[]" * 100, max_bytes=10, max_depth=5)


# ---------------------------------------------------------------------- the writer


def test_write_atomic_never_follows_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("mine")
    target = tmp_path / "out.json"
    target.symlink_to(victim)
    write_atomic(target, [b"new"])
    assert victim.read_text() == "mine"  # the link was replaced, not written through
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert (target.stat().st_mode & 0o777) == 0o600
    with pytest.raises(FileExistsError):
        write_atomic(target, [b"again"], exclusive=True)
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim"]  # no temp left


def test_checkpoint_files_are_private(ckpts: Path) -> None:
    for p in (ckpts / step_dir_name(GOOD)).iterdir():
        assert (p.stat().st_mode & 0o777) == 0o600, p
