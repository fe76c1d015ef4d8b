"""Loader wrappers and per-epoch functions (issue 14, item 2): a timm-like trainer whose epoch
loop in ``main()`` calls ``train_one_epoch()``, which iterates a prefetcher (one batch ahead,
fails on an empty loader) or a generator around the DataLoader under ``enumerate()``.

SIGKILLs at chosen steps; the resumed run must end bit-identical to an uninterrupted one, print
the same per-batch lines (with the enumerate counter) once each apart from the iterations
recomputed after each kill (at most K+1), and never run a completed epoch again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    SCRIPTS,
    assert_bit_identical,
    clean_env,
    epoch_ends_run_again,
    final_line,
    over_recompute_bound,
    run_cfrun,
    shared_run,
)

K = 5
EPOCHS = 3
STEPS_PER_EPOCH = 16  # 256 samples, batch 16
TOTAL = EPOCHS * STEPS_PER_EPOCH
SCRIPT = str(SCRIPTS / "train_wrapped.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _cfrun(cwd: Path, name: str, wrapper: str, *extra: str, env: dict[str, str] | None = None):
    run = run_cfrun(["--interval", str(K), "--job-dir", name, *extra, SCRIPT, wrapper,
                     str(EPOCHS), f"{name}.pt"], cwd=cwd,
                    env={"ITER_LOG": str(cwd / f"{name}.iters"), **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    return run, torch.load(cwd / f"{name}.pt", weights_only=True)


def _batch_lines(stdout: str) -> list[str]:
    return [l for l in stdout.splitlines() if l.startswith("batch ")]


def _epoch_lines(stdout: str) -> list[str]:
    return [l for l in stdout.splitlines() if l.startswith("epoch ")]


def _check_resumed(run, ref_run, kills: list[int], iters: list[str]) -> None:
    """Bit-identical is checked by the caller; here: the printed lines, the recomputed
    iterations (<= K+1 per kill) and the completed epochs (never again)."""
    resumed = [e["step"] for e in run.events("resumed")]
    assert len(resumed) == len(kills), run.stderr[-3000:]
    assert not over_recompute_bound(run, kills, resumed, K), (kills, resumed)
    assert len(iters) == TOTAL + sum(k - r for k, r in zip(kills, resumed)), (iters, resumed)
    # no completed epoch ran again: an epoch's end (validation, its line) runs a second time
    # only after a resume from a checkpoint taken before it (that of the epoch's last step, or
    # an older one when the newest was not committed at the kill)
    epochs = _epoch_lines(run.stdout)
    assert list(dict.fromkeys(epochs)) == _epoch_lines(ref_run.stdout)
    assert len(epochs) - EPOCHS == epoch_ends_run_again(kills, resumed, STEPS_PER_EPOCH,
                                                        EPOCHS), (epochs, kills, resumed)
    assert final_line(run.stdout) == final_line(ref_run.stdout)
    # per-batch lines (loss and the enumerate counter) as in the uninterrupted run, the
    # iterations between each checkpoint and its kill printed a second time
    got, ref = _batch_lines(run.stdout), _batch_lines(ref_run.stdout)
    assert len(got) == len(iters)
    deduped = list(dict.fromkeys(got))
    assert deduped == ref
    assert all(line.startswith(f"batch {i // STEPS_PER_EPOCH}:{i % STEPS_PER_EPOCH} ")
               for i, line in enumerate(ref))


@pytest.fixture
def references(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted runs under cfrun, one per wrapper, shared by this session's workers."""
    def reference(wrapper: str):
        run = shared_run(tmp_path_factory, f"wrapped-{wrapper}",
                         lambda cwd: _cfrun(cwd, "ref", wrapper)[0])
        assert len(run.events("attempt_start")) == 1, run.stderr[-3000:]
        assert len((run.cwd / "ref.iters").read_text().split()) == TOTAL
        return run, torch.load(run.cwd / "ref.pt", weights_only=True)
    return reference


@pytest.mark.parametrize("wrapper, inject, kills", [
    ("prefetcher", "20,37@1", [20, 37]),
    ("generator", "20,37@1", [20, 37]),
    pytest.param("both", "15,47@1", [15, 47], marks=pytest.mark.extended),
    pytest.param("library", "20,37@1", [20, 37], marks=pytest.mark.extended),
])
def test_wrapped_loader_in_a_per_epoch_function_resumes_bit_identical(
        references, tmp_path, wrapper, inject, kills):
    """The epoch loop in main() is jumped through train_one_epoch()'s call; the wrapper reads
    ahead across the checkpoint; enumerate() around the wrapper counts on. A wrapper from a
    library (another module, as Lightning Fabric's) is jumped too: its state is captured and
    put back (tests/integration/test_no_replay.py)."""
    ref_run, ref_state = references(wrapper)
    run, state = _cfrun(tmp_path, "got", wrapper, "--inject-crash", inject)
    assert_bit_identical(ref_state, state)
    iters = (tmp_path / "got.iters").read_text().split()
    _check_resumed(run, ref_run, kills, iters)
    assert "jumped to epoch index" in run.stderr
    assert "fast-forwarding" not in run.stderr  # nothing replayed
    assert not run.events("not_exact"), run.events("not_exact")


def test_a_replayed_epoch_loop_gives_the_prefetcher_a_batch(references, tmp_path):
    """An epoch loop over a list cannot be jumped: the completed epochs are replayed, and the
    prefetcher (which fails on an empty loader) gets one batch in each; still bit-identical."""
    ref_run, ref_state = references("prefetcher")
    run, state = _cfrun(tmp_path, "got", "prefetcher", "--inject-crash", "24,40@1",
                        env={"EPOCHS": "list"})
    assert_bit_identical(ref_state, state)
    assert "UnboundLocalError" not in run.stderr
    assert "with one training batch each" in run.stderr
    assert "its end-of-epoch code (validation, saving, logging) runs again" in run.stderr
    # the replayed epochs' single batches append to ITER_LOG (a file the script writes is
    # outside the guarantee) but print nothing: the printed lines are checked as above
    iters = (tmp_path / "got.iters").read_text().split()
    # each resume replays the epochs completed before its step (epoch 0 for a resume from 20,
    # none from 12, where deferral on a busy machine may put it), one batch each
    replayed = sum(e["step"] // STEPS_PER_EPOCH for e in run.events("resumed"))
    assert replayed >= 2, run.events("resumed")  # the second resume, from 35 or later
    _check_resumed(run, ref_run, [24, 40], iters[:len(iters) - replayed])


def test_a_resumed_wrapped_run_equals_plain_python(tmp_path):
    """The same script under plain ``python``: final weights and per-batch lines equal those of
    a cfrun run killed twice (a shuffled loader: cfrun draws the permutation as PyTorch does)."""
    env = clean_env({"SHUFFLE": "1"})
    plain = subprocess.run([sys.executable, SCRIPT, "prefetcher", str(EPOCHS), "plain.pt"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert plain.returncode == 0, plain.stderr[-3000:]
    run, state = _cfrun(tmp_path, "got", "prefetcher", "--inject-crash", "20,37@1",
                        env={"SHUFFLE": "1"})
    assert_bit_identical(torch.load(tmp_path / "plain.pt", weights_only=True), state)
    assert list(dict.fromkeys(_batch_lines(run.stdout))) == _batch_lines(plain.stdout)
    assert list(dict.fromkeys(_epoch_lines(run.stdout))) == _epoch_lines(plain.stdout)
    assert len(run.events("resumed")) == 2
