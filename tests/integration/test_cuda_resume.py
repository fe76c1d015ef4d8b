"""The CUDA path end to end (issue 18; GPU only, skipped without one): a CUDA AMP trainer
(float16 autocast, GradScaler, Adam, CUDA RNG) run plainly, under cfrun, and under cfrun
SIGKILLed twice must save bit-identical final states, in each copy mode, with the loop body on
the default stream or on a stream of its own (the step hook's events order the copy); and the
master-weight script on CUDA (item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, clean_env, run_cfrun

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _plain(cwd: Path, script: str, args: list[str]) -> dict:
    p = subprocess.run([sys.executable, str(SCRIPTS / script), "--out", "plain.pt", *args],
                       cwd=cwd, env=clean_env(ENV), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(cwd / "plain.pt", weights_only=True)


ROUNDS = range(int(os.environ.get("CFRUN_GPU_ROUNDS", "1")))
"""How many times each exactness test runs (issue 33: the thread mode resumed inexactly once in
several runs on an H200; ``CFRUN_GPU_ROUNDS=5`` on a GPU session runs each five times)."""


def _cfrun(cwd: Path, name: str, script: str, args: list[str], mode: str, kills: str,
           copy_delay_s: float = 0.0) -> dict:
    inject = ["--inject-crash", kills] if kills else []
    env = {**ENV, "CFRUN_SNAPSHOT_MODE": mode}
    if copy_delay_s:
        # the background copy held back: everything the script writes between the boundary and
        # the next step's gate (the GradScaler's scale, the next forward) runs before the copy
        env["CFRUN_FAULTS"] = json.dumps({"rank.snapshot_copy_delay_s": copy_delay_s})
    run = run_cfrun(["--interval", "4", *inject, "--job-dir", name, str(SCRIPTS / script),
                     "--out", f"{name}.pt", *args], cwd=cwd, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == (len(kills.split(",")) if kills else 0) + 1
    assert not run.events("not_exact") and not run.events("unprotected"), run.stderr[-3000:]
    assert run.events("checkpoint"), run.stderr[-3000:]
    assert "page-locked" not in run.stderr, run.stderr[-3000:]
    state = torch.load(cwd / f"{name}.pt", weights_only=True)
    # what a mismatch needs to be understood on a GPU session's time (issue 23: the thread
    # mode once ended not bit-identical after two kills on an H200)
    state["_events"] = [{k: e.get(k) for k in ("event", "step", "attempt", "due_step",
                                                "waits_for", "mode", "stall_s")}
                        for e in run.events() if e["event"] in (
                            "checkpoint", "checkpoint_deferred", "checkpoint_failed",
                            "resumed", "attempt_start")]
    return state


def _same(ref: dict, got: dict) -> None:
    """``got`` (a cfrun run's final state) equals the plain run's bit for bit; on a mismatch
    the run's checkpoint events are in the message."""
    events = got.pop("_events")
    try:
        assert_bit_identical(ref, got)
    except AssertionError as e:
        raise AssertionError(f"{e}; events: {events}") from None


@pytest.mark.parametrize("round_", ROUNDS)
@pytest.mark.parametrize("mode, side", [("thread", False), ("gpu", True), ("host", True),
                                        ("inline", False)])
def test_cuda_amp_resumes_bit_exactly_after_kills(tmp_path: Path, mode: str, side: bool,
                                                  round_: int):
    args = ["--steps", "40"] + (["--side-stream"] if side else [])
    ref = _plain(tmp_path, "train_cuda_amp.py", args)
    _same(ref, _cfrun(tmp_path, "plain", "train_cuda_amp.py", args, mode, ""))
    _same(ref, _cfrun(tmp_path, "kills", "train_cuda_amp.py", args, mode, "10@0,27@1"))


@pytest.mark.parametrize("round_", ROUNDS)
@pytest.mark.parametrize("mode, side", [("thread", False), ("thread", True), ("gpu", True),
                                        ("gpu", False), ("host", True)])
def test_cuda_amp_with_the_copy_held_back_resumes_bit_exactly(tmp_path: Path, mode: str,
                                                              side: bool, round_: int):
    """Issue 33: the background copy starts 50 ms late, so the next iteration's forward, the
    GradScaler's update and the step's gate all meet a copy still running; the checkpoints hold
    the boundary's values and the killed run ends bit-identical with the plain one. The script
    runs under ``torch.use_deterministic_algorithms(True)``, whose ``torch.empty`` fills the
    staging buffer (thread and gpu modes) on the training stream: once in five rounds on an
    H200 that fill landed between the side stream's two copies, the resumed checkpoint held
    NaN and the GradScaler found inf at every later step (scale 128 against 1048576). ``gpu``
    on the default stream stages at every checkpoint, as ``thread`` does where memory allows."""
    args = ["--steps", "40"] + (["--side-stream"] if side else [])
    ref = _plain(tmp_path, "train_cuda_amp.py", args)
    _same(ref, _cfrun(tmp_path, "kills", "train_cuda_amp.py", args, mode, "10@0,27@1",
                      copy_delay_s=0.05))


def test_master_weights_on_cuda_resume_bit_exactly(tmp_path: Path):
    args = ["--steps", "30", "--device", "cuda"]
    ref = _plain(tmp_path, "train_master_weights.py", args)
    _same(ref, _cfrun(tmp_path, "kills", "train_master_weights.py", args, "thread", "9@0,22@1"))


def test_a_slot_on_a_disk_is_not_page_locked_and_leaves_no_cuda_error(tmp_path: Path):
    """Issue 23: with the slots on a disk file system (here CFRUN_SHM_DIR on the test's disk;
    in production the ``<job_dir>/.slots`` fallback when /dev/shm is small),
    ``cudaHostRegister`` of the slot's mapping failed with "invalid argument" and left the
    error pending, so the script's next CUDA call failed. cfrun now says why the slot is not
    page-locked, copies from the snapshot thread, and the run resumes bit for bit."""
    from cfrun.contract import slots

    shm = tmp_path / "disk-slots"
    shm.mkdir(mode=0o700)
    if slots.fs_type(shm) in slots.MEMORY_FS_TYPES:
        pytest.skip("the test's directory is in RAM here: no disk to put the slots on")
    args = ["--steps", "30"]
    ref = _plain(tmp_path, "train_cuda_amp.py", args)
    run = run_cfrun(["--interval", "4", "--inject-crash", "10@0", "--job-dir", "j",
                     str(SCRIPTS / "train_cuda_amp.py"), "--out", "j.pt", *args], cwd=tmp_path,
                    env={**ENV, "CFRUN_SHM_DIR": str(shm)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "not tmpfs/hugetlbfs" in run.stderr, run.stderr[-3000:]
    assert not run.events("checkpoint_failed") and not run.events("unprotected")
    assert_bit_identical(ref, torch.load(tmp_path / "j.pt", weights_only=True))
