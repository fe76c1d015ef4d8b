"""The frameworks people train with, each SIGKILLed 3 times and resumed (README, "Frameworks").

Each test runs an example under ``examples/`` plainly (``python``, or ``torchrun`` for the DDP
one) and under cfrun with three injected SIGKILLs, then asserts bit-identical final weights and
the same printed lines. Each framework is skipped when it is not installed (``pip install -e
'.[test]'`` installs them). A step loop drawing batches with ``next()`` from an iterator it
holds (the shape of the Hugging Face Trainer's loop, written in a script) resumes exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import (
    EXAMPLES,
    SCRIPTS,
    assert_bit_identical,
    assert_resumed_from_newest,
    final_line,
    over_recompute_bound,
    run_cfrun,
)
from conftest import (
    plain_run as _plain,
)

from cfrun.contract import faults

# ~60 s each on an idle 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WARNING = "WARNING: resume may not be exact: "


def _lines(stdout: str, prefix: str) -> list[str]:
    """The script's lines starting with ``prefix``, each once (steps between a checkpoint and
    a kill run, and print, twice)."""
    return list(dict.fromkeys(l for l in stdout.splitlines() if l.startswith(prefix)))


def _landed(run, persist_kill: int) -> list[int]:
    """The steps the kills landed after: the kill during the persist of checkpoint
    ``persist_kill``, then each ``--inject-crash`` kill. An injected kill after an epoch's last
    step lands at the next boundary: accelerate's ``DataLoaderShard`` (under the Trainer too)
    calls no ``next()`` between an epoch's last step and the next epoch's first step."""
    return [persist_kill] + [int(m) for m in re.findall(
        r"injected crash: SIGKILL after step (\d+)", run.stderr)]


def _warned(stderr: str) -> list[str]:
    return [l.split(WARNING, 1)[1] for l in stderr.splitlines() if WARNING in l]


def _verify_says_exact(tmp_path: Path, args: list[str]):
    """``cfrun verify --interval 3 ARGS`` (its temporary job dirs under ``tmp_path``): exit 0,
    the ``exact`` verdict, no temporary job dir left; returns the run."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = run_cfrun(["verify", "--interval", "3", *args], cwd=tmp_path,
                    env={"TMPDIR": str(tmp)}, timeout=570)
    report = run.stdout[run.stdout.rfind("cfrun verify: "):]
    assert run.returncode == 0, report + run.stderr[-3000:]
    assert report.splitlines()[-1].startswith("exact: every entry bit-identical at step "), report
    assert not list(tmp.glob("cfrun-verify-*")), "a temporary job dir was left behind"
    return run, report


def _saved_checkpoints(out_dir):
    """The user's own ``save_steps`` checkpoints: name -> (TrainerState JSON, weights bytes)."""
    return {d.name: ((d / "trainer_state.json").read_text(),
                     (d / "model.safetensors").read_bytes())
            for d in sorted(out_dir.glob("checkpoint-*"))}


def test_hf_trainer_resumes_bit_identical(tmp_path):
    """``transformers.Trainer.train()`` without arguments (gradient_accumulation_steps=2, 7
    batches per epoch, linear warmup, dropout, a log line per step, the user's ``save_steps=5``),
    SIGKILLed during the persist of step 3, inside epoch 1 (step 7) and right after epoch 1's
    last step (8): every logged loss, learning rate and grad norm, the train loss, the final
    weights and the user's checkpoints (TrainerState and weights) equal the plain ``python``
    run's, with no ``not_exact`` reason (:mod:`cfrun.rank.adapters.hf`). Before, the Trainer's
    loop started over at epoch 0 and step 0 and the run differed."""
    pytest.importorskip("transformers")
    script = str(SCRIPTS / "train_hf_trainer.py")
    plain = _plain([script, "plain.pt", "plain_out"], tmp_path)
    kills = [3, 7, 8]
    run = run_cfrun(["--interval", "3", "--job-dir", "j", "--inject-crash", "7@1,8@2",
                     script, "cf.pt", "cf_out"], cwd=tmp_path, timeout=540,
                    env=faults.arm({}, **{"rank.kill_after_snapshot": kills[0]}))
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = [e["step"] for e in run.events("resumed")]
    assert len(resumed) == 3 and resumed[0] == kills[0], run.stderr[-3000:]
    assert not run.events("not_exact"), _warned(run.stderr)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "cf.pt"))
    assert _lines(run.stdout, "log step") == _lines(plain.stdout, "log step")
    assert len(_lines(plain.stdout, "log step")) == 13  # 12 steps and the epoch's end
    assert final_line(run.stdout) == final_line(plain.stdout)
    saved = _saved_checkpoints(tmp_path / "plain_out")
    assert list(saved) == ["checkpoint-10", "checkpoint-12", "checkpoint-5"]
    assert _saved_checkpoints(tmp_path / "cf_out") == saved
    assert not over_recompute_bound(run, _landed(run, kills[0]), resumed, 3), resumed


@pytest.mark.extended  # verify's kills: test_verify.py; this script's resume: the test above
def test_cfrun_verify_says_exact_on_the_hf_trainer_script(tmp_path):
    """``cfrun verify --interval 3 train_hf_trainer.py out.pt out_dir 4`` (README,
    "Frameworks"): the Trainer's state at the stop step after 3 kills (inside an epoch, right
    after an epoch's last step, during a persist) is bit-identical to the uninterrupted run's,
    the loader position included (:mod:`cfrun.rank.adapters.hf` records the Trainer's)."""
    pytest.importorskip("transformers")
    run, report = _verify_says_exact(tmp_path, [str(SCRIPTS / "train_hf_trainer.py"), "out.pt",
                                                "out_dir", "4"])
    assert report.count("SIGKILLed") == 3, report


def _two_ranks_killed(tmp_path: Path, script: str, out: str, kills: str, persist_kill: int):
    """Plain ``torchrun`` and cfrun on 2 ranks (``--interval 3``) of ``script OUT.pt OUT_DIR
    5``, cfrun's rank 0 SIGKILLed during the persist of step ``persist_kill`` and at
    ``kills``: both runs, rank 0's resume steps (0: from scratch), no
    ``not_exact`` reason and bit-identical final weights checked."""
    plain = _plain(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    script, "plain.pt", f"plain_{out}", "5"], tmp_path)
    run = run_cfrun(["--nproc-per-node", "2", "--interval", "3", "--job-dir", "j",
                     "--inject-crash", kills, script, "cf.pt", f"cf_{out}", "5"],
                    cwd=tmp_path, timeout=540,
                    env=faults.arm({}, **{"rank.kill_after_snapshot": persist_kill}))
    assert run.returncode == 0, run.stderr[-3000:]
    # each restart from the newest step committed before it; the first from persist_kill's
    # checkpoint, or from scratch when rank 1 was stopped before it handed its shard of that
    # checkpoint off (rank 0's kill ends the attempt; a busy machine makes rank 1 late)
    resumed = assert_resumed_from_newest(run, 3)
    assert resumed[0] in (persist_kill, 0), resumed
    assert not run.events("not_exact"), _warned(run.stderr)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "cf.pt"))
    return plain, run, resumed


@pytest.mark.extended  # DDP under a framework: Lightning's and Fabric's (test_no_replay.py)
def test_hf_trainer_ddp_two_ranks_resumes_bit_identical(tmp_path):
    """The same Trainer script under DDP on 2 ranks (gloo; 4 batches per rank and epoch, 2
    optimizer steps), 5 epochs, SIGKILLed during the persist of step 3, inside epoch 2 (step
    5) and right after epoch 3's last step (8): logs, train loss, final weights and the user's
    checkpoints equal ``torchrun``'s."""
    pytest.importorskip("transformers")
    plain, run, resumed = _two_ranks_killed(tmp_path, str(SCRIPTS / "train_hf_trainer.py"),
                                            "out", "5@1,8@2", 3)
    assert _lines(run.stdout, "log step") == _lines(plain.stdout, "log step")
    assert final_line(run.stdout) == final_line(plain.stdout) and "step 10" in final_line(
        plain.stdout)
    saved = _saved_checkpoints(tmp_path / "plain_out")
    assert list(saved) == ["checkpoint-10", "checkpoint-5"]
    assert _saved_checkpoints(tmp_path / "cf_out") == saved
    assert not over_recompute_bound(run, _landed(run, 3), resumed, 3), resumed


def _assert_same_checkpoints(plain_dir, cf_dir,
                             left_over: set[str] = frozenset()) -> list[str]:
    """The user's own ``ModelCheckpoint`` files in ``cf_dir`` are those in ``plain_dir``, with
    the same weights, loops, optimizer and scheduler states, epoch and global step, and the
    same callbacks, besides any of ``left_over`` (files a lost attempt wrote that a restart from
    scratch cannot know); returns their names."""
    def load(d):
        return {p.name: torch.load(p, weights_only=False) for p in sorted(d.glob("*.ckpt"))}

    saved, got = load(plain_dir), load(cf_dir)
    assert set(got) - set(saved) <= set(left_over), (list(got), list(saved))
    got = {name: ckpt for name, ckpt in got.items() if name in saved}
    assert list(got) == list(saved)
    for name, ckpt in saved.items():
        assert got[name]["callbacks"].keys() == ckpt["callbacks"].keys()
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "epoch",
                    "global_step"):
            assert_bit_identical(ckpt[key], got[name][key], f"{name}:{key}")
    return list(saved)


def test_lightning_trainer_resumes_bit_identical(tmp_path):
    """``lightning.Trainer.fit(model, loader, val_loader)`` without ``ckpt_path`` (6 batches per
    epoch, a per-step ``StepLR``, dropout, validation after batches 3 and 6, the user's two
    ``ModelCheckpoint`` callbacks), SIGKILLed during the persist of step 3 (a validation step),
    inside epoch 1 (step 8) and right after epoch 1's last step (12, landing after the next
    epoch's first step, at the first boundary of its loader iterator): every printed loss,
    learning rate and validation loss, the final weights, the best checkpoint and the user's
    checkpoint files equal the plain ``python`` run's, with no ``not_exact`` reason
    (:mod:`cfrun.rank.adapters.lightning`). Before, the fit loop started over at epoch 0 and
    step 0 and the run differed."""
    pytest.importorskip("lightning")
    script = str(SCRIPTS / "train_lightning.py")
    plain = _plain([script, "plain.pt", "plain_ck"], tmp_path)
    kills = [3, 8, 12]
    run = run_cfrun(["--interval", "3", "--job-dir", "j", "--inject-crash", "8@1,12@2",
                     script, "cf.pt", "cf_ck"], cwd=tmp_path, timeout=540,
                    env=faults.arm({}, **{"rank.kill_after_snapshot": kills[0]}))
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = [e["step"] for e in run.events("resumed")]
    assert len(resumed) == 3 and resumed[0] == kills[0], run.stderr[-3000:]
    assert not run.events("not_exact"), _warned(run.stderr)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "cf.pt"))
    assert _lines(run.stdout, "log ") == _lines(plain.stdout, "log ")
    assert len(_lines(plain.stdout, "log ")) == 24  # 18 steps, 6 validations
    assert final_line(run.stdout) == final_line(plain.stdout).replace("plain_ck", "cf_ck")
    assert _assert_same_checkpoints(tmp_path / "plain_ck", tmp_path / "cf_ck") == [
        "best-step=12.ckpt", "best-step=15.ckpt", "every-step=10.ckpt", "every-step=15.ckpt",
        "every-step=5.ckpt"]
    assert not over_recompute_bound(run, _landed(run, kills[0]), resumed, 3), resumed


@pytest.mark.extended  # verify's kills: test_verify.py; this script's resume: the test above
def test_cfrun_verify_says_exact_on_the_lightning_trainer_script(tmp_path):
    """``cfrun verify --interval 3 train_lightning.py out.pt ck`` (README, "Frameworks"). The
    stop step it chooses (12) is an epoch's last step, whose boundary Lightning's loop puts
    after the next epoch's first step: both runs stop, and are compared, at step 13. The
    killed run's ``CombinedLoader`` counts the resumed epoch's batches from the epoch's start,
    as the uninterrupted run's does (:mod:`cfrun.rank.adapters.lightning`); the
    ``ModelCheckpoint`` file names, ``-v1`` in the second run because the first left its files
    in ``ck``, differ between two uninterrupted runs as well and are set aside. Before: exit 2
    (no checkpoint at step 12), and with ``--steps 11``, ``not exact`` on the loader
    position (``_idx`` 5 vs 2) and the callbacks' paths."""
    pytest.importorskip("lightning")
    run, report = _verify_says_exact(tmp_path, [str(SCRIPTS / "train_lightning.py"), "out.pt",
                                                "ck"])
    assert "compared at step 13:" in report and report.count("SIGKILLed") == 3, report
    assert "loader position of" not in report, report


def test_lightning_trainer_ddp_two_ranks_resumes_bit_identical(tmp_path):
    """The same Lightning script under DDP on 2 ranks (gloo; 3 batches per rank and epoch,
    validation after every batch, synced ``val_loss``), 5 epochs, SIGKILLed during the persist
    of step 4 (the checkpoint due at epoch 0's last step, taken after the next epoch's first
    step), inside epoch 2 (step 8) and right after epoch 3's last step (12): printed
    losses, final weights, the best checkpoint and the user's checkpoint files equal
    ``torchrun``'s."""
    pytest.importorskip("lightning")
    plain, run, resumed = _two_ranks_killed(tmp_path, str(SCRIPTS / "train_lightning.py"),
                                            "ck", "8@1,12@2", 4)
    assert _lines(run.stdout, "log ") == _lines(plain.stdout, "log ")
    assert final_line(run.stdout) == final_line(plain.stdout).replace("plain_ck", "cf_ck") \
        and "step 15" in final_line(plain.stdout)
    # A restart from scratch (rank 1 stopped before it handed off its shard of step 4) cannot
    # know the best-step files the lost attempt wrote, as a restarted torchrun could not (files
    # are outside the guarantee: docs/resume-semantics.md); its ModelCheckpoint writes "-v1"
    # beside them and rotates only its own.
    left_over = {f"best-step={n}.ckpt" for n in range(1, 5)} if resumed[0] == 0 else set()
    _assert_same_checkpoints(tmp_path / "plain_ck", tmp_path / "cf_ck", left_over)
    assert not over_recompute_bound(run, _landed(run, 4), resumed, 3), resumed


def test_accelerate_gradient_accumulation_resumes_bit_identical(tmp_path):
    """An ``accelerate`` loop with ``gradient_accumulation_steps=2``, 7 batches per epoch (the
    epoch's last batch steps alone), a per-step scheduler and dropout, SIGKILLed during the
    persist of step 3, inside epoch 1 (step 7) and right after epoch 2's last step (12): every
    printed loss and the final weights equal the plain ``python`` run's, with no ``not_exact``
    reason (:mod:`cfrun.rank.adapters.accelerate`). Before, the resume skipped the batch that
    ``DataLoaderShard`` had read ahead: the resumed epoch lost a batch and its losses differed."""
    pytest.importorskip("accelerate")
    script = str(SCRIPTS / "train_accelerate.py")
    plain = _plain([script, "plain.pt", "4"], tmp_path)
    kills = [3, 7, 12]
    run = run_cfrun(["--interval", "3", "--job-dir", "j", "--inject-crash", "7@1,12@2",
                     script, "cf.pt", "4"], cwd=tmp_path, timeout=540,
                    env=faults.arm({}, **{"rank.kill_after_snapshot": kills[0]}))
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = [e["step"] for e in run.events("resumed")]
    assert len(resumed) == 3 and resumed[0] == kills[0], run.stderr[-3000:]
    assert not run.events("not_exact"), _warned(run.stderr)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "cf.pt"))
    assert _lines(run.stdout, "epoch ") == _lines(plain.stdout, "epoch ")
    assert len(_lines(plain.stdout, "epoch ")) == 28
    assert final_line(run.stdout) == final_line(plain.stdout)
    assert not over_recompute_bound(run, _landed(run, kills[0]), resumed, 3), resumed


@pytest.mark.extended  # verify's kills: test_verify.py; this script's resume: the test above
def test_cfrun_verify_says_exact_on_the_accelerate_script(tmp_path):
    """``cfrun verify --interval 3 train_accelerate.py out.pt 4`` (README, "Frameworks"):
    with ``gradient_accumulation_steps=2``, the position recorded one batch before
    ``DataLoaderShard``'s read-ahead (:mod:`cfrun.rank.adapters.accelerate`) is the
    uninterrupted run's after 3 kills."""
    pytest.importorskip("accelerate")
    run, report = _verify_says_exact(tmp_path, [str(SCRIPTS / "train_accelerate.py"), "out.pt",
                                                "4"])
    assert report.count("SIGKILLed") == 3, report


@pytest.mark.extended  # Fabric DDP killed twice against torchrun: test_no_replay.py
def test_fabric_ddp_two_ranks_resumes_bit_identical(tmp_path):
    """Lightning Fabric, DDP on 2 ranks (gloo), ``fabric.setup_dataloaders`` and
    ``for batch_idx, (data, target) in enumerate(train_loader)`` (the README's example):
    rank 0 killed once, in its second epoch. (Kills in every epoch of a Fabric DDP loop, and
    its epoch ends run once: test_no_replay.py; one slow Fabric job per concern.)"""
    pytest.importorskip("lightning")
    script = str(EXAMPLES / "fabric_digits.py")
    plain = _plain(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    script, "--out", "plain.pt"], tmp_path)
    run = run_cfrun(["--nproc-per-node", "2", "--interval", "5", "--job-dir", "j",
                     "--inject-crash", "24@0", script, "--out", "cf.pt"], cwd=tmp_path,
                    timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len({(e["attempt"]) for e in run.events("resumed")}) == 1, run.stderr[-3000:]
    assert not run.events("not_exact"), _warned(run.stderr)
    assert_bit_identical(torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "cf.pt"))
    assert _lines(run.stdout, "Test set") == _lines(plain.stdout, "Test set")
    assert final_line(run.stdout) == final_line(plain.stdout)
    got, want = _lines(run.stdout, "Train Epoch"), _lines(plain.stdout, "Train Epoch")
    if got != want:
        # a resume restarted the counter: a second "[0/22]" line in an epoch (another batch)
        starts = [l.split(" Loss")[0] for l in got if re.search(r"\[0/\d+\]", l)]
        if len(starts) > len(set(starts)):
            pytest.xfail("the batch_idx of enumerate() around Fabric's loader wrapper restarts "
                         "at 0 after a resume (issue 14, item 2: loader wrappers)")
    assert got == want


@pytest.mark.parametrize("mode", ["for", pytest.param("while", marks=pytest.mark.extended)])
def test_next_from_a_held_iterator_resumes_bit_identical(tmp_path, mode):
    """A step loop (``for step in range`` / ``while step < n``) that draws 2 batches per step
    with ``next(it)`` from an iterator it keeps in a variable and makes again at StopIteration:
    on main it stopped with exit 5 after the second kill; now every kill resumes exactly,
    with no ``not_exact`` reason and at most K+1 steps computed again per kill."""
    script = str(SCRIPTS / "train_next.py")
    k = 7
    ref = run_cfrun(["--interval", str(k), "--job-dir", "ref", script, mode, "50", "ref.pt"],
                    cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    log = tmp_path / "got.iters"
    got = run_cfrun(["--interval", str(k), "--job-dir", "got", "--inject-crash",
                     "12@0,31@1,45@2", script, mode, "50", "got.pt"], cwd=tmp_path,
                    env={"ITER_LOG": str(log)})
    assert got.returncode == 0, got.stderr[-3000:]
    resumed = [e["step"] for e in got.events("resumed")]
    assert len(resumed) == 3, got.stderr[-3000:]
    assert not got.events("not_exact"), _warned(got.stderr)
    assert_bit_identical(torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "got.pt"))
    assert final_line(got.stdout) == final_line(ref.stdout)
    assert _lines(got.stdout, "step ") == _lines(ref.stdout, "step ")
    steps = [int(s) for s in log.read_text().split()]
    assert len(steps) == 50 + sum(kill - r for kill, r in zip((12, 31, 45), resumed))
    assert not over_recompute_bound(got, [12, 31, 45], resumed, k), resumed
