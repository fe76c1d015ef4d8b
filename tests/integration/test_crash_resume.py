"""Real ranks SIGKILLed at chosen points; the resumed run must equal an uninterrupted one.

Every case compares the final model, optimizer and scheduler state bit for bit and the script's
printed final metrics, and bounds the training iterations executed (at most K+1 extra per kill).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, assert_bit_identical, final_line, run_cfrun

K = 10
EPOCHS = 4
STEPS_PER_EPOCH = 23  # 1500 samples, batch 64, drop_last
TOTAL = EPOCHS * STEPS_PER_EPOCH

pytestmark = pytest.mark.timeout(400)


def _train(cwd: Path, name: str, *extra: str, env: dict[str, str] | None = None):
    iter_log = cwd / f"{name}.iters"
    run = run_cfrun(["--interval", str(K), "--job-dir", name, *extra,
                     str(SCRIPTS / "train_tiny.py"), "--epochs", str(EPOCHS),
                     "--out", f"{name}.pt"],
                    cwd=cwd, env={"ITER_LOG": str(iter_log), **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    iters = len(iter_log.read_text().splitlines())
    return run, torch.load(cwd / f"{name}.pt", weights_only=True), iters


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    cwd = tmp_path_factory.mktemp("ref")
    run, state, iters = _train(cwd, "ref")
    assert iters == TOTAL
    assert not run.events("attempt_end")[0]["returncode"]
    return run, state


@pytest.mark.parametrize("inject, kills, why", [
    ("35", 1, "mid-epoch"),
    ("40", 1, "right after a checkpoint"),
    (str(2 * STEPS_PER_EPOCH), 1, "at an epoch boundary (last step of an epoch)"),
    ("35@0,70@1", 2, "twice in one run"),
])
def test_sigkill_resume_is_bit_identical(reference, tmp_path, inject, kills, why):
    ref_run, ref_state = reference
    run, state, iters = _train(tmp_path, "crash", "--inject-crash", inject)
    resumed = [e["step"] for e in run.events("resumed")]
    killed = [int(p.split("@")[0]) for p in inject.split(",")]
    assert len(resumed) == kills, why
    assert_bit_identical(ref_state, state)
    assert final_line(run.stdout) == final_line(ref_run.stdout)
    # exactly the steps between the checkpoint and the kill ran twice, nothing before it
    assert iters == TOTAL + sum(k - r for k, r in zip(killed, resumed)), (why, iters, resumed)
    # checkpoints every K steps; one may be deferred while the previous one still persists
    assert all(0 <= k - r <= 2 * K for k, r in zip(killed, resumed)), (why, resumed)


def test_sigkill_during_validation(reference, tmp_path):
    ref_run, ref_state = reference
    run, state, iters = _train(tmp_path, "val", env={"DIE_IN_VAL_EPOCH": "1",
                                                     "DIE_MARKER": str(tmp_path / "marker")})
    assert (tmp_path / "marker").exists()
    assert len(run.events("resumed")) == 1
    assert_bit_identical(ref_state, state)
    assert final_line(run.stdout) == final_line(ref_run.stdout)
    assert TOTAL < iters <= TOTAL + 2 * K


def test_sigkill_while_checkpoint_is_written(reference, tmp_path):
    """The rank dies mid-snapshot of the checkpoint due at step 30: it is never used."""
    ref_run, ref_state = reference
    run, state, iters = _train(tmp_path, "mid", env={"CFRUN_TEST_KILL_BEFORE_COMMIT": "30"})
    [resumed] = [e["step"] for e in run.events("resumed")]
    commits_attempt0 = [e["step"] for e in run.events("commit")
                        if e["t_unix_s"] < run.events("attempt_end")[0]["t_unix_s"]]
    assert resumed < 30 and resumed == max(commits_attempt0)  # the torn one was never used
    assert_bit_identical(ref_state, state)
    assert final_line(run.stdout) == final_line(ref_run.stdout)
    assert not list((tmp_path / "mid" / "checkpoints").glob(".staging-*"))


def test_completed_epochs_are_not_run_again(reference, tmp_path):
    """Resuming in epoch 3 must not iterate epochs 0-2 (no validation, no output for them)."""
    ref_run, _ = reference
    run, _, _ = _train(tmp_path, "jump", "--inject-crash", str(3 * STEPS_PER_EPOCH + 5))
    epoch_lines = [l for l in run.stdout.splitlines() if l.startswith("epoch ")]
    ref_lines = [l for l in ref_run.stdout.splitlines() if l.startswith("epoch ")]
    assert epoch_lines == ref_lines  # each epoch printed once, identical
    assert "jumped to epoch index 3" in run.stderr


def test_gan_two_optimizers_and_grad_scalers_resume_bit_identical(tmp_path):
    """Two models, two optimizers per iteration, two GradScalers, a per-iteration scheduler."""
    script = str(SCRIPTS / "train_gan.py")
    ref = run_cfrun(["--interval", "8", "--job-dir", "ref", script, "ref.pt"], cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    got = run_cfrun(["--interval", "8", "--job-dir", "got", "--inject-crash", "37", script,
                     "got.pt"], cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    assert len(got.events("resumed")) == 1
    assert [e["step"] for e in ref.events("checkpoint")][0] == 8  # steps count iterations
    assert_bit_identical(torch.load(tmp_path / "ref.pt", weights_only=True),
                         torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(got.stdout) == final_line(ref.stdout)


def test_two_rank_ddp_with_distributed_sampler_resumes_bit_identical(tmp_path):
    """--nproc-per-node 2, gloo, DDP, DistributedSampler.set_epoch: rank 0 SIGKILLed."""
    script = str(SCRIPTS / "train_ddp.py")
    common = ["--nproc-per-node", "2", "--interval", "10"]
    ref = run_cfrun([*common, "--job-dir", "ref", script, "ref.pt"], cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # the uninterrupted run must not restart (a CI run once printed its last epoch twice)
    assert len(ref.events("attempt_start")) == 1, (ref.events("attempt_end"), ref.stderr[-4000:])
    got = run_cfrun([*common, "--job-dir", "got", "--inject-crash", "35", script, "got.pt"],
                    cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    [resumed] = {e["step"] for e in got.events("resumed")}  # both ranks, the same step
    assert 35 - 2 * 10 <= resumed <= 35
    assert_bit_identical(torch.load(tmp_path / "ref.pt", weights_only=True),
                         torch.load(tmp_path / "got.pt", weights_only=True))
    assert [l for l in got.stdout.splitlines() if l.startswith("epoch 2")] == \
        [l for l in ref.stdout.splitlines() if l.startswith("epoch 2")]
    # DeepFreeze 1/N: each rank persisted half of the 98 KiB weight and of its momentum buffer
    import json

    newest = sorted((tmp_path / "got" / "checkpoints").glob("step-*"))[-1]
    layouts = [json.loads((newest / f"rank-{r:05d}.json").read_text())["tree"]["sharded"]
               for r in (0, 1)]
    assert [len(l) for l in layouts] == [2, 2]  # the first layer's weight and momentum
    assert layouts[0][0]["shape"] == [384, 64] and layouts[0][0]["ranges"] == [[0, 192], [192, 384]]
    # and the script's `model = DDP(...)` is not saved again as a script variable
    doc = json.loads((newest / "rank-00000.json").read_text())
    assert [384, 64] not in [t["shape"] for t in doc["tensors"]]  # only the [192, 64] halves
