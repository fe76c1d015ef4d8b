"""Issue 32, findings 2, 3 and 4, with real cfrun runs on real job dirs and files a test writes.

* **Finding 4, authenticate before reading.** Every manifest the persist agent commits carries
  a MAC under the job dir's ``job.key``; every rank checks it before it opens a file the
  manifest names. A step planted in ``checkpoints/`` (a copy of the job's own with its step
  changed, one without a MAC, a 2 GiB sparse file under a manifest that names it) and a
  tampered manifest are skipped where they lie, said in one line and one event, and the
  resume comes from the newest checkpoint of the job, bit-identical; nothing is moved or
  deleted. A job dir of an older cfrun (no manifest with a MAC) still resumes.
* **Finding 2, the job dir's identity at rank start.** A job dir swapped for another (with a
  checkpoint that even carries the job's MAC) while the ranks start is never read: each rank
  checks the supervisor's (st_dev, st_ino) first, and the job stops with exit 5.
* **Finding 3, restore only what was captured.** A checkpoint that names a script variable the
  script never assigns (``print``) or moves a ``Path`` variable outside every directory the
  script names does neither: the job ends as it should, the file outside is untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    SCRIPTS,
    assert_bit_identical,
    clean_env,
    ddp_reference,
    final_line,
    job_events,
    resumable_steps,
    run_cfrun,
    signed_manifest,
    tiny_reference,
)

from cfrun.contract import faults
from cfrun.contract.checkpoints import MANIFEST, committed_steps
from cfrun.contract.errors import EXIT_FATAL
from cfrun.contract.jobdir import step_dir_name
from cfrun.contract.manifest import Manifest, read_manifest

pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("manifest_mac")]

TINY = [str(SCRIPTS / "train_tiny.py"), "--epochs", "4", "--out", "got.pt"]




def _listing(root: Path) -> list[tuple[str, int]]:
    """Every file under ``root`` with its size (sparse files by their apparent size)."""
    return sorted((str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def tiny_ref(tmp_path_factory: pytest.TempPathFactory):
    return tiny_reference(tmp_path_factory)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train_tiny.py killed at step 58 with no restart left: its two newest checkpoints kept,
    each with its manifest's MAC (copied by each test)."""
    cwd = tmp_path_factory.mktemp("crashed")
    run = run_cfrun(["--interval", "10", "--max-restarts", "0", "--job-dir", "j",
                     "--inject-crash", "58", *TINY], cwd=cwd)
    assert run.returncode == 4, run.stderr[-3000:]
    return cwd / "j"


def _copy_job(src: Path, cwd: Path, name: str = "j", **config: Any) -> Path:
    """A copy of job dir ``src`` as ``cwd/name`` whose recorded working directory is ``cwd``."""
    job = cwd / name
    shutil.copytree(src, job, symlinks=True)
    recorded = json.loads((job / "config.json").read_text())
    (job / "config.json").write_text(json.dumps({**recorded, "cwd": str(cwd), **config}))
    return job


def _two_newest(job: Path) -> tuple[int, int]:
    steps = committed_steps(job / "checkpoints")
    assert len(steps) == 2 and steps[1] < steps[0] <= 58, steps
    assert all(read_manifest(job / "checkpoints" / step_dir_name(s)).mac for s in steps)
    return steps[0], steps[1]


def _kept(ckpts: Path, step: int, manifest: dict[str, Any]) -> bool:
    """Whether the refused step ``step`` with ``manifest`` is still there, where it was or,
    where the job committed that step again itself, moved aside (``corrupt-step-N-<ms>``):
    never deleted."""
    places = [ckpts / step_dir_name(step),
              *ckpts.glob(f"corrupt-{step_dir_name(step)}-*")]
    return any((p / MANIFEST).is_file() and json.loads((p / MANIFEST).read_text()) == manifest
               for p in places)


def _plant(ckpts: Path, source: int, step: int, edit: Any) -> Path:
    """A copy of committed step ``source`` as step ``step``, its manifest's JSON edited."""
    dst = ckpts / step_dir_name(step)
    shutil.copytree(ckpts / step_dir_name(source), dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest["step"] = step
    edit(manifest)
    os.chmod(dst / MANIFEST, 0o600)
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


def _plant_sparse(ckpts: Path, source: int, step: int) -> Path:
    """Step ``step`` whose ``.bin`` is a 2 GiB sparse file, named with that size by a manifest
    without a MAC (the review's plant: it made the agent read and hash 2 GiB)."""
    dst = ckpts / step_dir_name(step)
    dst.mkdir()
    shutil.copy(ckpts / step_dir_name(source) / "rank-00000.json", dst)
    with open(dst / "rank-00000.bin", "wb") as f:
        f.truncate(2 << 30)
    old = read_manifest(ckpts / step_dir_name(source))
    files = [f.to_json() for f in old.files]
    for f in files:
        if f["name"] == "rank-00000.bin":
            f["nbytes"] = 2 << 30
    doc = {**old.to_json(), "step": step, "files": files}
    doc.pop("mac")
    (dst / MANIFEST).write_text(json.dumps(doc))
    return dst


def test_planted_steps_are_skipped_where_they_lie_and_the_job_s_newest_resumes(
        tiny_ref, crashed, tmp_path):
    """Three steps planted above the job's own: one with another step's MAC, one without a
    MAC, one naming a 2 GiB sparse file. None is opened: they stay as they were (on main the
    sparse one is read, hashed and moved aside, and the copy is resumed from), one warning and
    one ``checkpoint_refused`` event name them, the resume comes from the job's newest step,
    the run ends bit-identical, and retention deletes none of them."""
    ref_run, ref_state = tiny_ref
    job = _copy_job(crashed, tmp_path, max_restarts=2)
    ckpts = job / "checkpoints"
    newest, _ = _two_newest(job)
    _plant(ckpts, newest, 900, lambda m: None)  # the job's MAC over another step
    _plant(ckpts, newest, 901, lambda m: m.pop("mac"))  # no MAC at all
    _plant_sparse(ckpts, newest, 902)
    planted = {s: _listing(ckpts / step_dir_name(s)) for s in (900, 901, 902)}
    again = run_cfrun(["resume", "j"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert job_events(job, "resumed")[-1]["step"] == newest
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(again.stdout) == final_line(ref_run.stdout)
    for step, listing in planted.items():  # never opened, moved nor deleted
        assert _listing(ckpts / step_dir_name(step)) == listing, step
    [refused] = job_events(job, "checkpoint_refused")
    assert sorted(refused["steps"]) == [900, 901, 902] and refused["count"] == 3, refused
    assert not job_events(job, "checkpoint_corrupt")
    assert not [p for p in ckpts.iterdir() if p.name.startswith(("corrupt-", "incompatible-"))]
    lines = [line for line in again.stderr.splitlines() if "nothing deleted" in line]
    assert len(lines) == 1 and "3 more" not in lines[0] and "2 more" in lines[0], lines
    own = [s for s in committed_steps(ckpts) if s < 900]
    assert len(own) == 2 and own[0] > newest, own  # retention counted the job's own only


def test_a_tampered_manifest_falls_back_to_the_previous_step_and_stays(tiny_ref, crashed,
                                                                       tmp_path):
    """The newest manifest's meta edited, its MAC left: refused before any of its files is
    read, never deleted (where it is, or moved aside once the job commits that step itself
    again), and every rank resumes from the previous step, bit-identical (on main the edited
    manifest was resumed from)."""
    ref_run, ref_state = tiny_ref
    job = _copy_job(crashed, tmp_path, max_restarts=2, keep=5)
    ckpts = job / "checkpoints"
    newest, previous = _two_newest(job)
    path = ckpts / step_dir_name(newest) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["meta"]["epoch"] = 0
    os.chmod(path, 0o600)
    path.write_text(json.dumps(manifest))
    again = run_cfrun(["resume", "j"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert job_events(job, "resumed")[-1]["step"] == previous
    assert [e["steps"] for e in job_events(job, "checkpoint_refused")] == [[newest]]
    assert _kept(ckpts, newest, manifest)  # as it was, never deleted
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(again.stdout) == final_line(ref_run.stdout)


def test_two_ranks_both_refuse_a_tampered_manifest_and_resume_from_the_same_step(
        tmp_path, tmp_path_factory):
    """The same on 2 ranks (torchrun, gloo, DDP): both ranks refuse the tampered newest
    manifest before reading a file, rank 0 says it once, both resume from the previous step,
    and the rerun ends bit-identical to the uninterrupted run."""
    shared, first = ddp_reference(tmp_path_factory)
    shutil.copytree(shared.job_dir, tmp_path / "ref", symlinks=True)
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    (tmp_path / "ref" / "config.json").write_text(json.dumps({**config, "cwd": str(tmp_path)}))
    ckpts = tmp_path / "ref" / "checkpoints"
    newest, previous = resumable_steps(ckpts)[:2]  # not the final one, never resumed from
    path = ckpts / step_dir_name(newest) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["meta"]["batches"] += 1
    os.chmod(path, 0o600)
    path.write_text(json.dumps(manifest))
    again = run_cfrun(["resume", "--rerun", "ref"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = [e for e in job_events(tmp_path / "ref", "resumed")]
    assert sorted(e["rank"] for e in resumed) == [0, 1]
    assert {e["step"] for e in resumed} == {previous}
    assert [e["steps"] for e in job_events(tmp_path / "ref", "checkpoint_refused")] == [[newest]]
    assert _kept(ckpts, newest, manifest)
    assert_bit_identical(first, torch.load(tmp_path / "ref.pt", weights_only=True))


def test_a_job_dir_of_an_older_cfrun_without_macs_still_resumes(tiny_ref, crashed, tmp_path):
    """No manifest of the job dir carries a MAC (written before issue 32): the newest one is
    resumed from, as before the upgrade; the commits after it carry MACs."""
    ref_run, ref_state = tiny_ref
    job = _copy_job(crashed, tmp_path, max_restarts=2)
    ckpts = job / "checkpoints"
    newest, _ = _two_newest(job)
    for step in committed_steps(ckpts):
        path = ckpts / step_dir_name(step) / MANIFEST
        doc = json.loads(path.read_text())
        doc.pop("mac")
        os.chmod(path, 0o600)
        path.write_text(json.dumps(doc))
    again = run_cfrun(["resume", "j"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert job_events(job, "resumed")[-1]["step"] == newest
    assert not job_events(job, "checkpoint_refused")
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert all(read_manifest(ckpts / step_dir_name(s)).mac for s in committed_steps(ckpts))


# ---------------------------------------------------------------------- finding 2


def test_a_job_dir_swapped_while_the_rank_starts_is_never_read(crashed, tmp_path):
    """The review's swap: as the attempt's rank starts, the job dir is renamed away and another
    put in its place, holding a step 500 that even carries the job's MAC. The rank checks the
    job dir's (st_dev, st_ino) before it reads anything and stops; the supervisor, checking
    after the attempt, stops the job with exit 5. Nothing is resumed from step 500 (on main
    the rank resumed from it and the job ended 0)."""
    job = _copy_job(crashed, tmp_path, max_restarts=2)
    newest, _ = _two_newest(job)
    evil = tmp_path / "evil"
    shutil.copytree(job, evil, symlinks=True)
    planted = _plant(evil / "checkpoints", newest, 500, lambda m: m.pop("mac"))
    (planted / MANIFEST).write_bytes(signed_manifest(planted, read_manifest(planted)))
    starts = len(job_events(job, "attempt_start"))
    env = clean_env(faults.arm({}, **{"rank.start_delay_s": 5}))
    proc = subprocess.Popen([sys.executable, "-m", "cfrun", "resume", "j"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(job_events(job, "attempt_start")) <= starts:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.rename(job, tmp_path / "j.moved")  # the swap, as the rank imports torch
        os.rename(evil, job)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_FATAL, err[-3000:]
    assert "was replaced" in err, err[-3000:]
    for root in (job, tmp_path / "j.moved"):
        assert not [e for e in job_events(root, "resumed") if e["step"] == 500]
    assert (job / "checkpoints" / step_dir_name(500)).is_dir()  # the swapped-in dir's, unread


# ---------------------------------------------------------------------- finding 3


SCRIPT = """\
import pathlib
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
out = pathlib.Path("out")
out.mkdir(exist_ok=True)
best = out / "none.pt"
for step in range(40):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 3:
        best = out / "best.pt"
torch.save(model.state_dict(), best)
print("FINAL", step, best)
"""


def test_a_checkpoint_sets_no_uncaptured_name_and_no_path_outside_the_script_s(tmp_path):
    """The newest checkpoint's module record crafted (and sealed with the job's own key, as a
    checkpoint that got past every check would be): ``print`` set to a string, a name the
    script never assigns, and the ``Path`` variable ``best`` moved to a file outside the
    working directory. The resume sets neither (one warning each): the script prints its
    last line, saves to its own path under ``out/``, and the file outside is untouched (on
    main the job crash-looped on ``print`` and overwrote it)."""
    work = tmp_path / "w"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    first = run_cfrun(["--interval", "5", "--max-restarts", "0", "--inject-crash", "27",
                       "--job-dir", "j", "train.py"], cwd=work)
    assert first.returncode == 4, first.stderr[-3000:]
    ckpts = work / "j" / "checkpoints"
    newest = ckpts / step_dir_name(committed_steps(ckpts)[0])
    doc_path = newest / "rank-00000.json"
    doc = json.loads(doc_path.read_bytes())
    [record] = [r for r in doc["tree"]["script"] if r["code"][1] == "<module>"]
    assert record["values"]["best"]["v"]["v"] in ("out/best.pt", "out/none.pt"), record
    record["values"]["best"]["v"]["v"] = str(victim)
    record["values"]["print"] = {"kind": "value", "v": "not a function"}
    os.chmod(doc_path, 0o600)
    doc_path.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    old = read_manifest(newest)
    import xxhash

    from cfrun.contract.manifest import FileEntry

    files = [FileEntry(f.name, len(b), xxhash.xxh3_64_hexdigest(b))
             for f in old.files for b in [(newest / f.name).read_bytes()]]
    os.chmod(newest / MANIFEST, 0o600)
    (newest / MANIFEST).write_bytes(signed_manifest(newest, Manifest.build(
        old.step, 1, files, old.meta, committed_unix_s=old.committed_unix_s)))
    again = run_cfrun(["resume", "j"], cwd=work)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [e["step"] for e in job_events(work / "j", "resumed")] == [old.step]
    assert victim.read_text() == "precious\n"
    last = final_line(again.stdout)  # the script's own value kept: out/none.pt after 3
    assert last in ("FINAL 39 out/best.pt", "FINAL 39 out/none.pt"), again.stdout[-2000:]
    assert (work / last.split()[-1]).is_file()
    warned = [line for line in again.stderr.splitlines() if "WARNING" in line]
    assert any("print" in line and "never assigns" in line for line in warned), warned
    assert any("best" in line and str(victim) in line for line in warned), warned
