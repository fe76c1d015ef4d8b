"""Issue 27, item 2: a job that ends normally takes a final checkpoint of its last step, so
``cfrun export`` gives the script's final weights and says which step it exported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, run_cfrun

pytestmark = pytest.mark.timeout(600)


def _export(cwd: Path) -> tuple[str, dict]:
    run = run_cfrun(["export", "job", "out.pt"], cwd=cwd, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip(), torch.load(cwd / "out.pt", weights_only=True)


@pytest.mark.slow
def test_two_ranks_under_the_default_policy_export_the_last_step(tmp_path: Path) -> None:
    """DDP on 2 ranks (gloo; the script calls dist.destroy_process_group() before it ends),
    no --interval: the export is step 69, the script's last, bit-identical to its own final
    torch.save. The finished job is not run again; ``--rerun`` resumes from the newest
    checkpoint before the final one (which holds no loop position) and ends the same."""
    args = ["--nproc-per-node", "2", "--job-dir", "job", str(SCRIPTS / "train_ddp.py"), "ref.pt"]
    run = run_cfrun(args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    finals = run.events("final_checkpoint")
    assert [(e["step"], e["outcome"]) for e in finals] in ([(69, "committed")],
                                                          [(69, "already")]), finals
    line, got = _export(tmp_path)
    assert line.startswith("exported step 69 (the last step the script ran): "), line
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert_bit_identical(got, ref)

    again = run_cfrun(args, cwd=tmp_path)
    assert again.returncode == 0 and "finished at step 69" in again.stderr, again.stderr[-3000:]
    assert len(again.events("attempt_start")) == 1  # not run again

    (tmp_path / "ref.pt").unlink()
    rerun = run_cfrun([*args[:4], "--rerun", *args[4:]], cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = [e["step"] for e in rerun.events("resumed")]
    assert resumed and all(step < 69 for step in resumed), resumed
    assert_bit_identical(torch.load(tmp_path / "ref.pt", weights_only=True), ref)


@pytest.mark.parametrize("steps, interval, outcome", [(20, 7, "committed"),
                                                      (21, 21, "already")])
def test_a_scripts_main_locals_are_still_saved_at_its_end(tmp_path: Path, steps: int,
                                                          interval: int, outcome: str) -> None:
    """The model, optimizer and scheduler are locals of main(), gone before the process ends:
    the final checkpoint still holds them. At 21 steps with --interval 21 the last step's
    checkpoint was taken at the loop's end already (none in flight to defer it): no second."""
    run = run_cfrun(["--interval", str(interval), "--job-dir", "job",
                     str(SCRIPTS / "train_main_fn.py"), str(steps), "ref.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    if any(e["step"] == steps for e in run.events("checkpoint")):
        outcome = "already"  # a checkpoint deferred under load landed on the last step
    assert [(e["step"], e["outcome"]) for e in run.events("final_checkpoint")] == [
        (steps, outcome)]
    assert len([e for e in run.events("commit") if e["step"] == steps]) == 1
    line, got = _export(tmp_path)
    assert line.startswith(f"exported step {steps} (the last step the script ran): "), line
    assert_bit_identical(got, torch.load(tmp_path / "ref.pt", weights_only=True))
