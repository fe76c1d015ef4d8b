"""Host memory on resume with 1/N sharded persist (issue 18, item 10).

With DDP every rank persists its 1/N slice of the replicated state; on resume each rank needs
the full state back. Reading every rank's shard file whole and concatenating the slices held
about twice the full state per rank (and that times the ranks of a node). ``train_big_ddp.py``
(~268 MB of state per rank, 2 ranks) records each process's peak resident memory right after
its first optimizer step (the resumed one: after the restore, the background read of the
checkpoint done): the resumed attempt's peak may exceed the
first attempt's by at most 1.2 times one rank's full state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SCRIPTS, run_cfrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LIMIT = 1.2
"""Peak host memory a resume's load may add, in units of one rank's full state."""


def test_resume_loads_at_most_one_full_state_per_rank(tmp_path: Path):
    log = tmp_path / "mem.log"
    run = run_cfrun(["--nproc-per-node", "2", "--interval", "3", "--inject-crash", "5@0",
                     "--job-dir", "job", str(SCRIPTS / "train_big_ddp.py")],
                    cwd=tmp_path, env={"MEM_LOG": str(log), "STEPS": "7"}, timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == 2, run.stderr[-3000:]
    assert {e["step"] for e in run.events("resumed")} == {3}, run.events("resumed")
    state_bytes = int(next(l.split()[1] for l in run.stdout.splitlines()
                           if l.startswith("STATE_BYTES")))
    assert state_bytes > 250e6
    peaks: dict[str, list[int]] = {}
    for line in log.read_text().splitlines():
        rank, kb = line.split()
        peaks.setdefault(rank, []).append(int(kb) * 1024)
    assert sorted(peaks) == ["0", "1"] and all(len(p) == 2 for p in peaks.values()), peaks
    for rank, (first, resumed) in peaks.items():
        added = resumed - first
        print(f"rank {rank}: the resume's load added {added / 1e6:.0f} MB peak, "
              f"{added / state_bytes:.2f}x the {state_bytes / 1e6:.0f} MB state")
        assert added <= LIMIT * state_bytes, (rank, added, state_bytes)
