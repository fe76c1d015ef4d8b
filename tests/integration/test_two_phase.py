"""Two-phase checkpoints (snapshot in shared memory, persist by the agent) under real failures."""

from __future__ import annotations

import pytest
import torch

from cfrun.checkpoint import committed_steps, load_shard
from cfrun.jobdir import step_dir_name
from conftest import SCRIPTS, assert_bit_identical, final_line, run_cfrun

pytestmark = pytest.mark.timeout(300)
K = 10
ARGS = [str(SCRIPTS / "train_tiny.py"), "--epochs", "3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ref")
    run = run_cfrun(["--interval", str(K), "--job-dir", "ref", *ARGS, "--out", "ref.pt"], cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, torch.load(cwd / "ref.pt", weights_only=True)


def test_rank_killed_after_snapshot_handoff_still_commits(reference, tmp_path):
    """SIGKILL right after the snapshot of step 30 was handed off: the agent commits it anyway
    and the restarted rank resumes from it."""
    ref_run, ref_state = reference
    run = run_cfrun(["--interval", str(K), "--job-dir", "j", *ARGS, "--out", "got.pt"],
                    cwd=tmp_path, env={"CFRUN_TEST_KILL_AFTER_SNAPSHOT": "30"})
    assert run.returncode == 0, run.stderr[-3000:]
    handed_off = min(e["step"] for e in run.events("commit") if e["step"] >= 30)
    assert [e["step"] for e in run.events("resumed")] == [handed_off]  # 30, or later if deferred
    assert [e["returncode"] for e in run.events("attempt_end")][0] != 0
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(run.stdout) == final_line(ref_run.stdout)


def test_agent_killed_mid_write_is_restarted_and_training_goes_on(reference, tmp_path):
    ref_run, ref_state = reference
    run = run_cfrun(["--interval", str(K), "--keep", "100", "--job-dir", "j", *ARGS,
                     "--out", "got.pt"], cwd=tmp_path, env={"CFRUN_TEST_AGENT_KILL_AT": "30"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("agent_restart")) == 1
    assert len(run.events("attempt_start")) == 1  # the ranks never noticed
    [lost] = [e["step"] for e in run.events("persist_lost")]
    committed = committed_steps(tmp_path / "j" / "checkpoints")
    assert lost >= 30 and lost not in committed and max(committed) > lost
    assert not list((tmp_path / "j" / "checkpoints").glob(".staging-*"))
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))


def test_flipped_byte_is_detected_and_previous_checkpoint_used(reference, tmp_path):
    ref_run, ref_state = reference
    first = run_cfrun(["--interval", str(K), "--max-restarts", "0", "--job-dir", "j",
                       "--inject-crash", "55", *ARGS, "--out", "got.pt"], cwd=tmp_path)
    assert first.returncode == 4
    ckpts = tmp_path / "j" / "checkpoints"
    newest, previous = committed_steps(ckpts)[:2]
    shard = ckpts / step_dir_name(newest) / "rank-00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    run = run_cfrun(["resume", "j"], cwd=tmp_path)
    run.job_dir = tmp_path / "j"
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"checkpoint step {newest} failed verification" in run.stderr
    assert [e["step"] for e in run.events("resumed")] == [previous]
    assert [e["step"] for e in run.events("checkpoint_corrupt")] == [newest]
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))
    assert final_line(run.stdout) == final_line(ref_run.stdout)


def test_batchnorm_snapshot_equals_state_right_after_its_step(tmp_path):
    """Parameters are copied in the background while the next forward updates BatchNorm
    statistics and the next step waits at the gate: the snapshot is still exact."""
    run = run_cfrun(["--interval", "5", "--keep", "100", "--job-dir", "j",
                     str(SCRIPTS / "train_bn_probe.py"), "40", "10,15,20,25,30,35",
                     str(tmp_path)],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    ckpts = tmp_path / "j" / "checkpoints"
    checked = 0
    for step in (10, 15, 20, 25, 30, 35):
        if step not in committed_steps(ckpts):
            continue  # deferred while the previous checkpoint persisted
        state, meta = load_shard(ckpts / step_dir_name(step), 0)
        probe = torch.load(tmp_path / f"probe-{step}.pt", weights_only=True)
        assert_bit_identical(probe["model"], state["modules"][0])
        exp_avg = [s["exp_avg"] for _, s in sorted(state["optimizers"][0]["state"].items())]
        assert_bit_identical(probe["exp_avg"], exp_avg)
        checked += 1
    assert checked >= 2
    assert all(e["persist"] == "agent" for e in run.events("checkpoint"))
