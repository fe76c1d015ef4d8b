"""``cfrun ls``/``status``/``export`` as real processes on job dirs holding crafted checkpoints.

Each command must answer within its timeout (no hang on a FIFO, no read of /dev/zero), exit
with the documented code (ls: 5 when a checkpoint is corrupt, export: 2) and one line (plus a
hint), never a traceback, and leave the job dir exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import resumable_steps, run_cfrun, signed_manifest

from cfrun.codec.checkpoint import MANIFEST, commit, staging_dir, write_shard
from cfrun.codec.format import encode
from cfrun.contract.jobdir import step_dir_name
from cfrun.contract.manifest import FileEntry, Manifest, read_manifest

pytestmark = pytest.mark.timeout(300)  # the default: a loaded machine took over 120 s (issue 36)

GOOD, CRAFTED = 10, 20


def make_job(root: Path) -> Path:
    """A job dir as a finished run leaves it (config, events, two good checkpoints), written
    in-process: no training run needed."""
    jd = root / "j"
    (jd / "checkpoints").mkdir(parents=True)
    (jd / "config.json").write_text(json.dumps({"script": "train.py", "interval": 10}))
    (jd / "events.jsonl").write_text(json.dumps({"event": "state", "state": "succeeded"}) + "\n")
    for step in (GOOD, CRAFTED):
        g = torch.Generator().manual_seed(step)
        state = {"modules": [{"w": torch.randn(4, 3, generator=g), "b": torch.zeros(3)}]}
        tensors: list[torch.Tensor] = []
        tree = encode(state, tensors)
        files = write_shard(staging_dir(jd / "checkpoints", step), 0, tree, tensors,
                            {"step": step})
        commit(jd / "checkpoints", step, files, world_size=1, meta={"step": step, "epoch": 0},
               keep=None)
    return jd


def _reseal(step_dir: Path) -> None:
    old = read_manifest(step_dir)
    files = []
    for f in old.files:
        data = (step_dir / f.name).read_bytes()
        files.append(FileEntry(f.name, len(data), xxhash.xxh3_64_hexdigest(data)))
    (step_dir / MANIFEST).write_bytes(signed_manifest(step_dir, Manifest.build(
        old.step, 1, files, old.meta)))


def _nbytes_zero(d: Path) -> None:
    doc = json.loads((d / "rank-00000.json").read_bytes())
    doc["tensors"][0]["nbytes"] = 0
    (d / "rank-00000.json").write_bytes(json.dumps(doc).encode())
    _reseal(d)


def _huge_shape(d: Path) -> None:
    (d / "rank-00000.json").write_bytes(
        b'{"format_version":1,"tree":{"__t__":0},"tensors":[{"dtype":"float32",'
        b'"shape":[200000000],"offset":0,"nbytes":800000000,"device":"cpu"}]}')
    _reseal(d)


def _traversal(d: Path) -> None:
    m = json.loads((d / MANIFEST).read_bytes())
    m["files"].append({"name": "../../etc/hostname", "nbytes": 1, "xxh3_64": "0" * 16})
    (d / MANIFEST).write_text(json.dumps(m))


def _fifo(name: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / name).unlink()
        os.mkfifo(d / name)
    return make


def _dev_zero(name: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        (d / name).unlink()
        (d / name).symlink_to("/dev/zero")
    return make


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "nbytes 0": (_nbytes_zero, "nbytes 0 is not 48"),
    "huge shape in 88 bytes": (_huge_shape, "ends at byte 800000000"),
    "path traversal": (_traversal, "'../../etc/hostname' is not one a checkpoint has"),
    "fifo as shard": (_fifo("rank-00000.bin"), "not a regular file (a FIFO)"),
    "fifo as manifest": (_fifo(MANIFEST), "not a regular file (a FIFO)"),
    "/dev/zero as shard": (_dev_zero("rank-00000.bin"), "a symlink"),
    "/dev/zero as document": (_dev_zero("rank-00000.json"), "a symlink"),
}


HANG_S = 180
"""A command that meets a FIFO must not block on it: one that runs this long hangs (the bound
is loose, a busy machine's torch import alone took over a minute once)."""

def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: type, mode and (regular files) content digest."""
    out = {}
    for dirpath, dirnames, names in os.walk(root):
        for name in dirnames + names:
            p = Path(dirpath) / name
            st = p.lstat()
            kind = stat.S_IFMT(st.st_mode)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) \
                else os.readlink(p) if stat.S_ISLNK(st.st_mode) else ""
            out[str(p.relative_to(root))] = f"{kind} {oct(st.st_mode)} {digest}"
    return out


def _one_line(stderr: str, needle: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("cfrun: error:") and needle in lines[0], stderr
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint:")), stderr
    assert "Traceback" not in stderr


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_job(tmp_path_factory.mktemp("job"))


@pytest.mark.parametrize("case", list(CASES))
def test_inspection_commands_refuse_crafted_checkpoints(pristine: Path, tmp_path: Path,
                                                       case: str) -> None:
    jd = tmp_path / "j"
    shutil.copytree(pristine, jd)
    craft, needle = CASES[case]
    craft(jd / "checkpoints" / step_dir_name(CRAFTED))
    before = _snapshot(jd)

    ls = run_cfrun(["ls", "j", "--json"], cwd=tmp_path, timeout=HANG_S)
    assert ls.returncode == 5, (ls.stdout, ls.stderr)
    rows = json.loads(ls.stdout)
    assert [r["step"] for r in rows] == [CRAFTED, GOOD]
    assert rows[0]["verified"].startswith("corrupt") and needle in rows[0]["verified"]
    assert rows[1]["verified"] == "ok"
    _one_line(ls.stderr, needle)

    table = run_cfrun(["ls", "j"], cwd=tmp_path, timeout=HANG_S)
    assert table.returncode == 5 and "corrupt" in table.stdout, table.stderr
    _one_line(table.stderr, "1 of 2 checkpoints are corrupt")

    status = run_cfrun(["status", "j", "--json"], cwd=tmp_path, timeout=HANG_S)
    assert status.returncode == 0, status.stderr
    newest = json.loads(status.stdout)["last_committed_step"]
    assert newest == (GOOD if case in ("path traversal", "fifo as manifest") else CRAFTED)
    assert _snapshot(jd) == before  # nothing changed, nothing quarantined by a reader


@pytest.mark.parametrize("name, kind, needle", [
    ("events.jsonl", "fifo", "is refused"),
    ("config.json", "fifo", "not a cfrun job dir"),
    ("config.json", "link", "is refused"),
])
def test_status_refuses_special_files_for_its_own_files(pristine: Path, tmp_path: Path,
                                                        name: str, kind: str,
                                                        needle: str) -> None:
    jd = tmp_path / "j"
    shutil.copytree(pristine, jd)
    if kind == "fifo":
        (jd / name).unlink()
        os.mkfifo(jd / name)
    else:
        (jd / name).rename(tmp_path / "elsewhere.json")
        (jd / name).symlink_to(tmp_path / "elsewhere.json")
    before = _snapshot(jd)
    run = run_cfrun(["status", "j"], cwd=tmp_path, timeout=HANG_S)
    assert run.returncode == 2, (run.stdout, run.stderr)
    _one_line(run.stderr, needle)
    assert _snapshot(jd) == before


@pytest.mark.parametrize("case", ["nbytes 0", "fifo as shard", "/dev/zero as document"])
def test_export_refuses_crafted_checkpoints(pristine: Path, tmp_path: Path, case: str) -> None:
    """``export`` (which loads tensors, with torch) refuses in one line; the job dir stays."""
    jd = tmp_path / "j"
    shutil.copytree(pristine, jd)
    craft, needle = CASES[case]
    craft(jd / "checkpoints" / step_dir_name(CRAFTED))
    before = _snapshot(jd)
    export = run_cfrun(["export", "j", "out.pt"], cwd=tmp_path, timeout=HANG_S)  # newest: crafted
    assert export.returncode == 2, (export.stdout, export.stderr)
    _one_line(export.stderr, f"checkpoint step {CRAFTED} failed verification")
    assert needle in export.stderr and not (tmp_path / "out.pt").exists()
    assert _snapshot(jd) == before


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_refuses_a_dtype_lie_the_checksum_cannot_see(tmp_path: Path) -> None:
    """int32 written over float32 bytes has the right size and a valid (re-sealed) manifest;
    the rank compares every tensor with the live object before ``load_state_dict`` (which would
    convert it silently) and refuses the resume in one line, exit 5, the checkpoints untouched."""
    from conftest import SCRIPTS

    run = run_cfrun(["--interval", "10", "--job-dir", "j", "--max-restarts", "0",
                     str(SCRIPTS / "train_tiny.py"), "--epochs", "1", "--workers", "0",
                     "--out", "first.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    ckpts = tmp_path / "j" / "checkpoints"
    newest = ckpts / step_dir_name(resumable_steps(ckpts)[0])  # not the final one
    doc = json.loads((newest / "rank-00000.json").read_bytes())
    lied = next(e for e in doc["tensors"] if e["dtype"] == "float32")
    lied["dtype"] = "int32"
    (newest / "rank-00000.json").write_bytes(json.dumps(doc).encode())
    _reseal(newest)
    before = _tree_digest(ckpts)

    again = run_cfrun(["resume", "--rerun", "j"], cwd=tmp_path)
    assert again.returncode == 5, again.stderr[-2000:]
    refusal = [ln for ln in again.stderr.splitlines()
               if ln.startswith("cfrun: error:") and "does not fit" in ln]
    assert len(refusal) == 1 and "int32" in refusal[0] and "float32" in refusal[0], again.stderr
    assert _tree_digest(ckpts) == before
