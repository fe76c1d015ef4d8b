"""Loaders whose state carries over epochs resume exactly (issue 34, item 2).

timm's ``train.py`` with its defaults diverged in the epoch after a resumed one. Its loaders keep
their workers (``persistent_workers=True``), so PyTorch draws their base seed from the global
torch RNG at each loader's *first* ``iter()`` only, and each worker's random stream goes on from
epoch to epoch. A resumed run started the eval loader's workers anew after the resumed epoch:
one base-seed draw more than the uninterrupted run, so the next epoch's shuffle
(``RandomSampler`` seeds itself from the global RNG), mixup and everything after differed, the
final state first at the optimizer's momentum buffer, and the best metric with it. Now the
checkpoint carries every other loader's generator, persistent workers' base seed and per-worker
RNG states, and a resume restarts those workers as they were (:mod:`cfrun.rank.loader_carry`,
``carried_state``).

``train_timm_loader.py`` loads data as timm's ``create_loader`` does with its defaults (2
persistent workers seeded by a ``worker_init_fn`` from ``get_worker_info().seed``, timm's
``PrefetchLoader`` one batch ahead), augments with python/numpy/torch in the workers, mixes
batches with numpy/torch in the main process, accumulates 2 batches per optimizer step and keeps
the best eval metric: 4 epochs of 6 batches, 3 optimizer steps each, a checkpoint every 2 steps.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, plain_run, run_cfrun

from cfrun.contract import faults

pytestmark = pytest.mark.timeout(400)

SCRIPT = str(SCRIPTS / "train_timm_loader.py")
STEPS_PER_EPOCH = 3
KILLS = "3@0,5@1,9@2"  # after steps 3, 5 and 9: resumed in epochs 0, 1 and 2 (from step 2, 4
# and 8, or 6 when 8's persist is still in flight), each followed by another epoch


def _lines(stdout: str) -> list[str]:
    """The script's lines, each once (steps between a checkpoint and its kill print twice)."""
    return list(dict.fromkeys(l for l in stdout.splitlines()
                              if l.startswith(("train ", "eval ", "best "))))


def _killed_equals_plain(tmp_path: Path, *args: str) -> None:
    plain = plain_run([SCRIPT, "--out", "plain.pt", *args], tmp_path)
    run = run_cfrun(["--launcher", "python", "--interval", "2", "--inject-crash", KILLS,
                     "--job-dir", "job", SCRIPT, "--out", "got.pt", *args], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("resumed")) == 3, run.stderr[-3000:]
    # resumed in different epochs (0, 1, 2 on an idle machine; which checkpoint each kill
    # finds committed depends on deferrals under load: a kill at 9 once resumed from 9, in 3)
    epochs = [int(e) for e in re.findall(r"jumped to epoch index (\d+)", run.stderr)]
    assert len(epochs) == 3 and epochs == sorted(epochs) and len(set(epochs)) >= 2, run.stderr
    assert not run.events("not_exact"), run.events("not_exact")
    assert _lines(run.stdout) == _lines(plain.stdout)
    want = torch.load(tmp_path / "plain.pt", weights_only=True)
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert got["best_metric"] == want["best_metric"]
    assert got["best_epoch"] == want["best_epoch"]
    assert_bit_identical(want, got)


def test_timm_loader_defaults_resume_bit_identical_after_three_kills(tmp_path):
    """timm's defaults: the eval loader's persistent workers, started after each resumed
    epoch, no longer shift the next epoch's shuffle. On the code before, the epoch after the
    second resumed one (epoch 2) differed from its first batch on."""
    _killed_equals_plain(tmp_path)


def test_checkpoint_deferred_into_gradient_accumulation_waits_for_the_next_step(tmp_path):
    """Issue 36: a checkpoint deferred at its boundary (the previous one still in flight) is
    taken at the first ``next()`` after a later step, never at a later ``next()`` of the same
    step. There, with 2 batches per step, a backward had put gradients into ``.grad`` that no
    checkpoint holds: deferred from the boundary after step 8 (batch 4 of epoch 2) to the
    prefetcher's next ``next()`` (batch 5), checkpoint 8 resumed batch 5's step without batch
    4's gradients, and the resumed run validated epoch 2 again with that model
    (``eval 2 loss 0.7280497849``, a loaded machine's flake of the test above) and diverged
    from there on. The fault point defers it at step 8's boundary as a persist ending right
    after it does; no checkpoint comes due before (``--interval 8``)."""
    plain = plain_run([SCRIPT, "--out", "plain.pt"], tmp_path)
    run = run_cfrun(["--launcher", "python", "--interval", "8", "--inject-crash", "11@0",
                     "--job-dir", "job", SCRIPT, "--out", "got.pt"], cwd=tmp_path,
                    env=faults.arm({}, **{"rank.in_flight_at_step": 8}))
    assert run.returncode == 0, run.stderr[-3000:]
    assert [e["due_step"] for e in run.events("checkpoint_deferred")] == [8]
    assert [e["step"] for e in run.events("commit")][:1] == [9], run.events("commit")
    assert [e["step"] for e in run.events("resumed")] == [9], run.stderr[-3000:]
    assert not run.events("not_exact"), run.events("not_exact")
    assert _lines(run.stdout) == _lines(plain.stdout)
    want = torch.load(tmp_path / "plain.pt", weights_only=True)
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert got["best_metric"] == want["best_metric"]
    assert_bit_identical(want, got)


@pytest.mark.slow
def test_eval_workers_streams_generator_and_early_start_resume_bit_identical(tmp_path):
    """Beyond timm's defaults: a randomly augmented eval set (its persistent workers' streams
    carry over epochs), shuffled with a ``generator=`` of its own, and validated once before the
    epoch loop (the resumed run's eval workers already run when it reaches the checkpoint:
    they are restarted with the original run's base seed and streams)."""
    _killed_equals_plain(tmp_path, "--eval-augment", "--eval-generator", "--validate-first")


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A short TMPDIR for cfrun verify (its job dirs; the workers' AF_UNIX socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="cfv", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.extended  # verify: test_verify.py; these loaders: test_timm_loader_defaults_resume_*
def test_verify_says_exact_for_timm_loader_defaults(tmp_path, tmp):
    """``cfrun verify`` (its own 3 kills: before the first checkpoint, right after epoch 0's
    last step, during a persist in epoch 1) to step 11, in epoch 3: exact. Before, the state
    at step 11 differed."""
    run = run_cfrun(["verify", "--json", "--launcher", "python", "--interval", "2", "--steps",
                     "11", SCRIPT, "--out", "v.pt"], cwd=tmp_path, env={"TMPDIR": str(tmp)},
                    timeout=300)
    assert run.stdout.lstrip().startswith("{"), run.stdout[-2000:] + run.stderr[-3000:]
    rep = json.loads(run.stdout)
    assert run.returncode == 0, json.dumps(rep, indent=1) + run.stderr[-3000:]
    assert rep["verdict"] == "exact"
    assert any(k["resumed_from"] > STEPS_PER_EPOCH for k in rep["kills"]), rep["kills"]
    assert not (tmp_path / "v.pt").exists()
