"""Real ranks SIGKILLed at chosen points; the resumed run must equal an uninterrupted one.

Every case compares the final model, optimizer and scheduler state bit for bit and the script's
printed final metrics, and bounds the training iterations executed (at most K+1 extra per kill).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    SCRIPTS,
    assert_bit_identical,
    ddp_reference,
    final_line,
    over_recompute_bound,
    run_cfrun,
    slow_but,
    tiny_reference,
)

from cfrun.contract import faults

K = 10
EPOCHS = 4
STEPS_PER_EPOCH = 23  # 1500 samples, batch 64, drop_last
TOTAL = EPOCHS * STEPS_PER_EPOCH

pytestmark = [pytest.mark.timeout(400), pytest.mark.launched]  # as users launch


def _train(cwd: Path, name: str, *extra: str, env: dict[str, str] | None = None,
           interval: int = K):
    iter_log = cwd / f"{name}.iters"
    run = run_cfrun(["--interval", str(interval), "--job-dir", name, *extra,
                     str(SCRIPTS / "train_tiny.py"), "--epochs", str(EPOCHS),
                     "--out", f"{name}.pt"],
                    cwd=cwd, env={"ITER_LOG": str(iter_log), **(env or {})})
    assert run.returncode == 0, run.stderr[-3000:]
    iters = len(iter_log.read_text().splitlines())
    return run, torch.load(cwd / f"{name}.pt", weights_only=True), iters


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run (``_train`` with --epochs 4, shared with other modules)."""
    run, state = tiny_reference(tmp_path_factory)
    assert len((run.cwd / "ref.iters").read_text().splitlines()) == TOTAL
    assert not run.events("attempt_end")[0]["returncode"]
    return run, state


@pytest.mark.parametrize("inject, kills, why", slow_but([
    ("35", 1, "mid-epoch"),
    ("35@0,70@1", 2, "twice in one run"),
], ("35@0,70@1", 2, "twice in one run")))
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
    # the acceptance bound: at most K+1 iterations computed again per kill (more only after a
    # checkpoint deferred while the previous one persisted, as its event says)
    assert not over_recompute_bound(run, killed, resumed, K), (why, resumed)


def _epoch_lines(stdout: str) -> list[str]:
    return [l for l in stdout.splitlines() if l.startswith("epoch ")]


@pytest.mark.parametrize("interval, step, why", [
    (K, 40, "right after a checkpoint (mid-epoch)"),
    (STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH,
     "at an epoch boundary: checkpoint 46 is the last step of epoch 1, before its validation"),
])
@pytest.mark.slow
def test_sigkill_right_after_a_checkpoint_resumes_from_it(reference, tmp_path, interval, step,
                                                           why):
    """SIGKILLed right after checkpoint ``step`` was handed to the persist agent: it is
    committed anyway, the resume starts from it and no iteration is computed twice."""
    ref_run, ref_state = reference
    run, state, iters = _train(tmp_path, "after", interval=interval,
                               env=faults.arm({}, **{"rank.kill_after_snapshot": step}))
    assert len(run.events("attempt_start")) == 2, why
    assert [e["step"] for e in run.events("resumed")] == [step], why
    assert iters - TOTAL <= 1, (why, iters)  # nothing before the checkpoint ran again
    assert_bit_identical(ref_state, state)
    assert final_line(run.stdout) == final_line(ref_run.stdout)
    assert _epoch_lines(run.stdout) == _epoch_lines(ref_run.stdout), why  # each printed once


@pytest.mark.slow
def test_sigkill_during_validation(reference, tmp_path):
    ref_run, ref_state = reference
    run, state, iters = _train(tmp_path, "val", env={"DIE_IN_VAL_EPOCH": "1",
                                                     "DIE_MARKER": str(tmp_path / "marker")})
    assert (tmp_path / "marker").exists()
    assert len(run.events("resumed")) == 1
    assert_bit_identical(ref_state, state)
    assert final_line(run.stdout) == final_line(ref_run.stdout)
    # at most K+1 iterations computed again (more only after a deferred checkpoint)
    assert TOTAL < iters <= TOTAL + K + 1 or run.events("checkpoint_deferred"), iters


@pytest.mark.slow
def test_sigkill_while_checkpoint_is_written(reference, tmp_path):
    """The rank dies mid-snapshot of the checkpoint due at step 30: it is never used."""
    ref_run, ref_state = reference
    run, state, iters = _train(tmp_path, "mid",
                               env=faults.arm({}, **{"rank.kill_before_handoff": 30}))
    [resumed] = [e["step"] for e in run.events("resumed")]
    commits_attempt0 = [e["step"] for e in run.events("commit")
                        if e["t_unix_s"] < run.events("attempt_end")[0]["t_unix_s"]]
    assert resumed < 30 and resumed == max(commits_attempt0)  # the torn one was never used
    assert_bit_identical(ref_state, state)
    assert final_line(run.stdout) == final_line(ref_run.stdout)
    assert not list((tmp_path / "mid" / "checkpoints").glob(".staging-*"))


@pytest.mark.slow
def test_completed_epochs_are_not_run_again(reference, tmp_path):
    """Resuming in epoch 3 must not iterate epochs 0-2 (no validation, no output for them)."""
    ref_run, _ = reference
    log = tmp_path / "getitem.log"
    run, _, _ = _train(tmp_path, "jump", "--inject-crash", str(3 * STEPS_PER_EPOCH + 5),
                       env={"GETITEM_LOG": str(log)})
    epoch_lines = [l for l in run.stdout.splitlines() if l.startswith("epoch ")]
    ref_lines = [l for l in ref_run.stdout.splitlines() if l.startswith("epoch ")]
    assert epoch_lines == ref_lines  # each epoch printed once, identical
    assert "jumped to epoch index 3" in run.stderr
    # skipped epochs and batches load no data: the resumed attempt's workers fetched exactly
    # the samples of the batches after the checkpoint (sampler-level skip, no load-and-discard)
    [resumed] = [e["step"] for e in run.events("resumed")]
    loaded_by: dict[str, int] = {}
    for line in log.read_text().splitlines():
        parent = line.split()[0]
        loaded_by[parent] = loaded_by.get(parent, 0) + 1
    assert len(loaded_by) == 2, loaded_by  # one training process per attempt
    assert list(loaded_by.values())[-1] == (TOTAL - resumed) * 64, (resumed, loaded_by)


@pytest.mark.slow
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


@pytest.mark.slow
def test_two_rank_ddp_with_distributed_sampler_resumes_bit_identical(tmp_path,
                                                                       tmp_path_factory):
    """--nproc-per-node 2, gloo, DDP, DistributedSampler.set_epoch: rank 0 SIGKILLed."""
    script = str(SCRIPTS / "train_ddp.py")
    common = ["--nproc-per-node", "2", "--interval", "10"]
    ref, ref_state = ddp_reference(tmp_path_factory)  # --keep 3; shared with other modules
    # the uninterrupted run must not restart (a CI run once printed its last epoch twice)
    assert len(ref.events("attempt_start")) == 1, (ref.events("attempt_end"), ref.stderr[-4000:])
    got = run_cfrun([*common, "--job-dir", "got", "--inject-crash", "35", script, "got.pt"],
                    cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    [resumed] = {e["step"] for e in got.events("resumed")}  # both ranks, the same step
    assert 35 - 2 * 10 <= resumed <= 35
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
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


@pytest.mark.slow
def test_a_changed_training_loader_is_refused(tmp_path):
    """Resuming with another batch size stops with exit 5 and a one-line error, instead of
    jumping to the checkpoint's epoch and silently training on without the checkpoint."""
    script = str(SCRIPTS / "train_loader_small.py")
    # checkpoints from 18 to 42, the crash at 47: any one of them is in epoch 1 or 2, and
    # steps held 0.1 s give the persist of 18 about 3 s to commit (steps of ~1 ms once left a
    # loaded CI machine with only the checkpoint of step 6 committed by the crash)
    first = run_cfrun(["--interval", "6", "--job-dir", "j", "--inject-crash", "47",
                       "--max-restarts", "0", script, "16", "a.pt"], cwd=tmp_path,
                      env=faults.arm({}, **{"rank.step_delay_s": 0.1}))
    assert first.returncode == 4, first.stderr[-3000:]
    ckpts = tmp_path / "j" / "checkpoints"
    before = sorted(p.name for p in ckpts.iterdir())
    newest = max(int(n[5:]) for n in before if n.startswith("step-"))
    assert 16 < newest <= 47  # past epoch 0 (16 batches per epoch)
    again = run_cfrun(["--interval", "6", "--job-dir", "j", "--accept-changed-command", script,
                       "32", "b.pt"], cwd=tmp_path)  # accepted: the ranks' own check refuses
    assert again.returncode == 5, again.stderr[-3000:]
    [line] = [l for l in again.stderr.splitlines() if l.startswith("cfrun: error:")]
    assert "training DataLoader" in line and "batch_size 16 -> 32" in line, line
    assert "epoch" not in again.stdout and "FINAL" not in again.stdout
    assert not (tmp_path / "b.pt").exists()
    assert sorted(p.name for p in ckpts.iterdir()) == before


@pytest.mark.slow
def test_replayed_epoch_loop_resumes_bit_identical(tmp_path):
    """``for epoch in list(range(4))`` cannot be jumped: cfrun replays epochs 0-1 with an
    empty training loader, the script's output muted and its torch.save disabled; the per-epoch
    scheduler.step() of the replay leaves no trace."""
    script = str(SCRIPTS / "train_replay.py")
    (tmp_path / "ref").mkdir()
    (tmp_path / "got").mkdir()
    ref = run_cfrun(["--interval", "5", "--job-dir", "ref-job", script, "ref"], cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # checkpoints from 35 on are in epoch 2; the crash at 47 leaves the persist of 35 twelve
    # steps however loaded the machine is (at most one checkpoint is in flight)
    got = run_cfrun(["--interval", "5", "--job-dir", "got-job", "--inject-crash", "47", script,
                     "got"], cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    [resumed] = [e["step"] for e in got.events("resumed")]
    assert 32 < resumed <= 47  # inside epoch 2 (16 batches per epoch)
    assert "fast-forwarding 2 completed epoch(s)" in got.stderr
    assert_bit_identical(torch.load(tmp_path / "ref" / "final.pt", weights_only=True),
                         torch.load(tmp_path / "got" / "final.pt", weights_only=True))
    assert final_line(got.stdout) == final_line(ref.stdout)
    assert _epoch_lines(got.stdout) == _epoch_lines(ref.stdout)  # each printed once
    restarted_s = got.events("attempt_start")[1]["t_unix_s"]
    for epoch in (0, 1):  # the script's own files of replayed epochs are not rewritten
        assert (tmp_path / "got" / f"epoch-{epoch}.pt").stat().st_mtime < restarted_s
    assert (tmp_path / "got" / "epoch-2.pt").stat().st_mtime > restarted_s
