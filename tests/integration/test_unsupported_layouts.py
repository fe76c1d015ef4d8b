"""States cfrun cannot checkpoint are said to be unprotected, never claimed saved (issue 18,
item 9): FSDP1 (its refusal names FSDP2's fully_shard, issue 25), a whole-step CUDA graph.
DTensor states (FSDP2, tensor parallelism) are checkpointed: tests/integration/test_fsdp2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, run_cfrun

pytestmark = pytest.mark.timeout(300)


def _unprotected(tmp_path: Path, kind: str, word: str, where: str) -> str:
    run = run_cfrun(["--interval", "2", "--job-dir", "job", str(SCRIPTS / "train_fsdp1.py"),
                     kind], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DONE" in run.stdout
    events = run.events("unprotected")
    assert [e["where"] for e in events] == [where], events
    assert word in events[0]["error"]
    lines = [l for l in run.stderr.splitlines() if word in l]
    assert len(lines) == 1 and "unprotected" in lines[0], run.stderr[-3000:]
    assert "saved as it is" not in run.stderr
    assert not run.events("checkpoint") and not run.events("checkpoint_failed")
    assert not list((run.job_dir / "checkpoints").glob("step-*"))
    return str(events[0]["error"])


@pytest.mark.launched  # one rank of a process group: RANK and MASTER_* as torchrun sets them
def test_fsdp1_makes_the_job_unprotected_in_one_line(tmp_path: Path):
    """FSDP1 on CPU (gloo): refused at the first step, no checkpoint taken."""
    why = _unprotected(tmp_path, "fsdp1", "FullyShardedDataParallel", "FSDP1")
    assert "fully_shard" in why  # names what to use instead (issue 25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_whole_step_cuda_graph_makes_the_job_unprotected(tmp_path: Path):
    """Issue 18, item 11: an optimizer step captured in a CUDA graph fires its hooks once, at
    the capture; its replays advance training unseen. Said once, never silent."""
    run = run_cfrun(["--interval", "2", "--job-dir", "job", str(SCRIPTS / "train_cuda_graph.py")],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DONE" in run.stdout
    events = run.events("unprotected")
    assert [e["where"] for e in events] == ["CUDA graph"], events
