"""A resume runs no end-of-epoch code of a completed epoch (issue 22, item 9).

timm's ``train.py`` reads its training loader through ``PrefetchLoader``, a library's wrapper;
cfrun used to replay the completed epochs through it (one batch each, with stdout and
``torch.save`` suppressed), so the script validated and saved them again and timm's saver failed
on ``os.replace`` of the ``tmp.pth.tar`` that was never written. Now the ``for epoch in
range(...)`` loop is jumped and the wrapper's state (its prefetched batch, Lightning Fabric's
``iter()`` count, the sampler's epoch) is captured and put back.

Three scripts, each SIGKILLed once in each of its 3 epochs (16 steps each, ``--interval 4``,
every kill at least 2 intervals into its epoch, so that the checkpoint it resumes from, or the
one before it, is in the killed epoch and no epoch end is legitimately recomputed): a timm-shaped
trainer (``train_timm.py`` with ``timm_lib.py``), a trainer whose loader is read through a
library generator (``train_wrapped.py library``) and a Lightning Fabric DDP loop on 2 ranks
(``train_fabric_epochs.py``). Each counts its ``validate()`` and ``save()`` runs in a file it
appends to with ``os.write``, which cfrun never suppresses, so a replayed epoch end shows. The
killed run must equal the plain ``python`` run bit for bit (the Fabric one: ``torchrun``'s), and
each epoch end must have run exactly once.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, clean_env, final_line, run_cfrun
from conftest import plain_run as _plain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

K = 4
KILLS = "27@0,43@1"  # steps 27, 43: epochs 1 and 2 (16 steps each), after 1 and 2 completed
# epochs (a kill in epoch 0 has no completed epoch to replay: an attempt less per run)
EPOCHS = 3


def _cfrun(cwd: Path, name: str, ranks: int, script: list[str], *extra: str):
    run = run_cfrun(["--nproc-per-node", str(ranks), "--interval", str(K), "--job-dir",
                     f"job-{name}", *extra, *script], cwd=cwd, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _check_killed(run) -> None:
    """Each kill resumed by a jump of the epoch loop, nothing replayed, nothing inexact."""
    resumed = [e for e in run.events("resumed") if e.get("rank", 0) == 0]
    assert len(resumed) == 2, run.stderr[-3000:]
    assert all(16 * (i + 1) <= e["step"] for i, e in enumerate(resumed)), resumed
    assert "fast-forwarding" not in run.stderr, run.stderr[-3000:]
    assert "jumped to epoch index 2 of the epoch loop" in run.stderr
    assert not run.events("not_exact"), run.events("not_exact")


def _lines(stdout: str, prefix: str) -> list[str]:
    """The script's lines starting with ``prefix``, each once (steps between a checkpoint and
    its kill run, and print, twice)."""
    return list(dict.fromkeys(l for l in stdout.splitlines() if l.startswith(prefix)))


def _saved(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_timm_train_py_resumes_without_validating_or_saving_completed_epochs(tmp_path):
    """timm's structure: PrefetchLoader (one batch ahead, a library's), train_one_epoch(),
    validate(), CheckpointSaver (tmp.pth.tar then os.replace; the best 2 epochs kept, the
    others deleted, which needs the saver's own list back after a resume), summary.csv. On
    main the second resume replayed epoch 0 and the saver's os.replace failed (exit 5)."""
    runs = {}
    for name in ("plain", "got"):  # the killed run against the plain one: no third run
        script = [str(SCRIPTS / "train_timm.py"), "--output", f"out-{name}", "--out",
                  f"{name}.pt"]
        if name == "plain":
            runs[name] = _plain(script, tmp_path)
        else:
            extra = ("--inject-crash", KILLS) if name == "got" else ()
            runs[name] = _cfrun(tmp_path, name, 1, script, *extra)
    _check_killed(runs["got"])
    want = ["validate", "save 0", "validate", "save 1", "validate", "save 2"]
    plain_out = tmp_path / "out-plain"
    for name in ("plain", "got"):
        out = tmp_path / f"out-{name}"
        assert (out / "epoch_ends.log").read_text().split("\n")[:-1] == want, name
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in
                                                                plain_out.iterdir()), name
        assert (out / "summary.csv").read_text() == (plain_out / "summary.csv").read_text()
        for f in ("last.pth.tar", "model_best.pth.tar", "checkpoint-0.pth.tar"):
            assert_bit_identical(_saved(plain_out / f), _saved(out / f), f"{name}/{f}")
        assert_bit_identical(_saved(tmp_path / "plain.pt"), _saved(tmp_path / f"{name}.pt"))
        assert _lines(runs[name].stdout, "Test:") == _lines(runs["plain"].stdout, "Test:")
        assert _lines(runs[name].stdout, "Train:") == _lines(runs["plain"].stdout, "Train:")
        assert final_line(runs[name].stdout) == final_line(runs["plain"].stdout)


@pytest.mark.extended  # a library's generator: test_loader_wrappers.py; the jump: the other two
def test_a_library_generator_wrapper_resumes_without_validating_or_saving_again(tmp_path):
    """train_wrapped.py's ``library`` wrapper (a generator of another module, as a framework's)
    with an epoch loop that calls validate() and save() (torch.save to a temporary file, then
    os.replace): on main completed epochs were replayed through it and validated again."""
    runs = {}
    for name in ("plain", "got"):  # the killed run against the plain one: no third run
        script = [str(SCRIPTS / "train_wrapped.py"), "library", str(EPOCHS), f"{name}.pt"]
        env = {"EPOCH_LOG": str(tmp_path / f"{name}.log")}
        if name == "plain":
            p = subprocess.run([sys.executable, *script], cwd=tmp_path, env=clean_env(env),
                               capture_output=True, text=True, timeout=400)
            assert p.returncode == 0, p.stderr[-3000:]
            runs[name] = p
            continue
        extra = ["--inject-crash", KILLS] if name == "got" else []
        run = run_cfrun(["--interval", str(K), "--job-dir", f"job-{name}", *extra, *script],
                        cwd=tmp_path, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = run
    _check_killed(runs["got"])
    want = [x for e in range(EPOCHS) for x in ("validate", f"save {e}")]
    for name in ("plain", "got"):
        assert (tmp_path / f"{name}.log").read_text().split("\n")[:-1] == want, name
        assert_bit_identical(_saved(tmp_path / "plain.pt"), _saved(tmp_path / f"{name}.pt"))
        assert_bit_identical(_saved(tmp_path / "plain.pt.epoch"),
                             _saved(tmp_path / f"{name}.pt.epoch"))
        assert _lines(runs[name].stdout, "epoch ") == _lines(runs["plain"].stdout, "epoch ")
        assert _lines(runs[name].stdout, "batch ") == _lines(runs["plain"].stdout, "batch ")


def test_fabric_ddp_resumes_without_validating_or_saving_completed_epochs(tmp_path):
    """Lightning Fabric on 2 ranks: ``setup_dataloaders`` wraps the loader in
    ``_FabricDataLoader``, whose ``iter()`` count sets the DistributedSampler's epoch. The
    jump puts the count and the sampler's epoch back (the resumed and later epochs draw the
    permutations of the uninterrupted run); on main the completed epochs were replayed
    through the wrapper and validated and saved again."""
    pytest.importorskip("lightning")
    script = str(SCRIPTS / "train_fabric_epochs.py")
    runs = {}
    for name in ("plain", "got"):  # 2 ranks on a loaded machine: the uninterrupted cfrun
        # run is compared with torchrun by test_transparency.py and test_frameworks.py
        args = [script, "--out", f"{name}.pt", "--count-log", f"{name}.log"]
        if name == "plain":
            runs[name] = _plain(["-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "2", *args], tmp_path)
        else:
            extra = ("--inject-crash", KILLS) if name == "got" else ()
            runs[name] = _cfrun(tmp_path, name, 2, args, *extra)
    _check_killed(runs["got"])
    want = collections.Counter([f"validate rank {r}" for r in (0, 1)] * EPOCHS
                               + [f"save {e}" for e in range(EPOCHS)])
    for name in ("plain", "got"):
        got = (tmp_path / f"{name}.log").read_text().split("\n")[:-1]
        assert collections.Counter(got) == want, (name, got)
        assert [l for l in got if l.startswith("save")] == [f"save {e}" for e in range(EPOCHS)]
        assert_bit_identical(_saved(tmp_path / "plain.pt"), _saved(tmp_path / f"{name}.pt"))
        assert_bit_identical(_saved(tmp_path / "plain.pt.epoch"),
                             _saved(tmp_path / f"{name}.pt.epoch"))
        for prefix in ("Validation", "Train Epoch", "FINAL"):
            assert _lines(runs[name].stdout, prefix) == _lines(runs["plain"].stdout, prefix)
