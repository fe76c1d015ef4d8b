"""Sharded models resume exactly (issue 25, items 1 and 2): FSDP2 (``fully_shard``), FSDP2 with
a ``MixedPrecisionPolicy`` and tensor parallelism (``parallelize_module``) on 2 ranks with gloo
on CPU, and FSDP2 x TP on a 2 x 2 mesh. Each configuration is one cfrun run with two real
SIGKILLs (``--inject-crash``) compared, bit for bit and loss by loss, with plain torchrun; the
FSDP2 one also measures what a checkpoint holds per rank (its local shards only) and exports
it (full weights, DCP). Without issue 25 such a job
took no checkpoint (an ``unprotected`` event): a kill started it over, and no ``resumed`` event
came."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    SCRIPTS,
    Run,
    assert_bit_identical,
    final_line,
    over_recompute_bound,
    plain_run,
    run_cfrun,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCRIPT = str(SCRIPTS / "train_fsdp2.py")
STEPS = 24  # 2 epochs of 12 batches per data-parallel rank
INTERVAL = 5
KILLS = [8, 17]  # rank 0 SIGKILLed after step 8 (attempt 0) and step 17 (attempt 1)


def _losses(stdout: str) -> list[str]:
    return [l for l in stdout.splitlines() if l.startswith("loss ")]


def _states(cwd: Path, name: str, nproc: int) -> list[Any]:
    return [torch.load(cwd / f"{name}-rank{r}.pt", weights_only=True) for r in range(nproc)]


def _killed_run(tmp_path: Path, kind: str, nproc: int,
                env: dict[str, str] | None = None) -> tuple[Run, Any]:
    """Plain torchrun, then cfrun with two kills, of ``kind``; the kill-resume run must equal
    torchrun: every rank's final shards, and the loss at every step (a redone step prints its
    loss again, the same). (No uninterrupted cfrun run: it is the killed run's stretch before
    its first kill, and test_transparency.py compares cfrun with torchrun in general.)"""
    plain = plain_run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(nproc), SCRIPT, kind, "plain"], tmp_path)
    kills = ",".join(f"{k}@{a}" for a, k in enumerate(KILLS))
    run = run_cfrun(["--nproc-per-node", str(nproc), "--interval", str(INTERVAL), "--job-dir",
                     "got", "--inject-crash", kills, SCRIPT, kind, "got"], cwd=tmp_path,
                    env=env, timeout=840)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not run.events("unprotected"), run.events("unprotected")
    resumed = sorted({(e["attempt"], e["step"]) for e in run.events("resumed")})
    assert [a for a, _ in resumed] == [1, 2], run.stderr[-3000:]
    steps = [s for _, s in resumed]
    assert all(s > 0 for s in steps), steps  # from a checkpoint, not from the start
    assert not over_recompute_bound(run, KILLS, steps, INTERVAL), (KILLS, steps)
    for a, b in zip(_states(tmp_path, "plain", nproc), _states(tmp_path, "got", nproc)):
        assert_bit_identical(a, b)
    want, got = _losses(plain.stdout), _losses(run.stdout)
    assert len(want) == STEPS
    assert any(got == want[:a] + want[steps[0]:b] + want[steps[1]:]
               for a in range(STEPS + 1) for b in range(STEPS + 1)), (got, want, steps)
    assert final_line(run.stdout) == final_line(plain.stdout)
    return run, plain


def _stored_bytes(tree: Any, table: list[dict[str, Any]]) -> tuple[int, int]:
    """(bytes of DTensor local shards, bytes of plain tensors) a checkpoint tree refers to."""
    if isinstance(tree, dict):
        if "__dt__" in tree:
            return table[tree["__dt__"]]["nbytes"], 0
        if "__t__" in tree:
            return 0, table[tree["__t__"]]["nbytes"]
        parts = [_stored_bytes(v, table) for v in tree.values()]
    elif isinstance(tree, list):
        parts = [_stored_bytes(v, table) for v in tree]
    else:
        return 0, 0
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def test_fsdp2_resumes_bit_identical_after_two_kills_with_local_shards_only(tmp_path):
    """FSDP2 on every layer and the root, Adam, gradient clipping: the kill-resume run equals
    torchrun; each rank's checkpoint holds its own local shards (half of every parameter and
    Adam moment), never the full model."""
    run, _ = _killed_run(tmp_path, "fsdp2", 2, env={"SAVE_STEPS": "1"})
    # memory: what a rank's checkpoint holds of the model and optimizer (what its snapshot
    # copies into host memory) is its local shards' bytes, and the two ranks' shards are
    # distinct: together exactly the full model and its Adam moments, once
    full = _states(tmp_path, "got", 2)  # each rank's local shards, saved by the script
    local_bytes = [sum(t.numel() * t.element_size() for part in (s["model"], *s["opt"].values())
                       for t in part.values() if t.dim() > 0) for s in full]
    full_bytes = 3 * 4 * (32 * 64 + 64 + 64 * 32 + 32 + 32 * 2 + 2)  # params + 2 moments, fp32
    assert sum(local_bytes) == full_bytes
    step = max(e["step"] for e in run.events("commit"))
    step_dir = run.job_dir / "checkpoints" / f"step-{step:06d}"
    for r in (0, 1):
        doc = json.loads((step_dir / f"rank-{r:05d}.json").read_text())
        tree, table = doc["tree"], doc["tensors"]
        shard_bytes, plain_bytes = _stored_bytes([tree["modules"], tree["optimizers"]], table)
        assert shard_bytes == local_bytes[r] <= full_bytes // 2, (r, shard_bytes)
        assert plain_bytes < 1024, plain_bytes  # the buffer, Adam's step counters
        assert [64, 32] not in [t["shape"] for t in table]  # w1.weight: its [32, 32] half
    _check_export(tmp_path, step)


def _check_export(tmp_path: Path, step: int) -> None:
    """Issue 25, item 5: ``cfrun export`` of the FSDP2 checkpoint writes the full weights (put
    together from both ranks' shards) as of that step; ``--format dcp`` loads with DCP into the
    same model unsharded, in one process (another world size)."""
    import torch.distributed.checkpoint as dcp

    shards = [torch.load(tmp_path / f"got-rank{r}-step{step}.pt", weights_only=True)
              for r in (0, 1)]
    want = {k: torch.cat([s[k] for s in shards]) if v.dim() else v
            for k, v in shards[0].items()}  # fully_shard: Shard(0) on a 2-rank mesh
    for fmt in ("torch", "dcp"):
        done = run_cfrun(["export", "got", f"out-{fmt}", "--step", str(step), "--format", fmt],
                         cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    assert_bit_identical(want, torch.load(tmp_path / "out-torch", weights_only=True))
    loaded = {k: torch.zeros_like(v) for k, v in want.items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled...": one process, meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(loaded, checkpoint_id=str(tmp_path / "out-dcp"), no_dist=True)
    assert_bit_identical(want, loaded)


@pytest.mark.parametrize("kind", [pytest.param("fsdp2-mp", marks=pytest.mark.extended), "tp"])
def test_sharded_two_ranks_resume_bit_identical_after_two_kills(tmp_path, kind):
    """FSDP2 with bf16 parameters and fp32 reduce; tensor parallelism (colwise, rowwise)."""
    _killed_run(tmp_path, kind, 2)


@pytest.mark.extended  # FSDP2 and TP each: the tests above
def test_fsdp2_over_tensor_parallel_on_a_2x2_mesh_resumes_bit_identical(tmp_path):
    """4 ranks, a ``dp`` x ``tp`` mesh: TP's colwise/rowwise shards inside, FSDP2 across (its
    parameters placed ``_StridedShard`` x ``Shard``)."""
    run, _ = _killed_run(tmp_path, "fsdp2-tp", 4)
    doc = json.loads(next((run.job_dir / "checkpoints").glob("step-*/rank-00000.json"))
                     .read_text())
    meta = doc["tree"]["modules"][0]["w1.weight"]["meta"]
    assert meta["mesh"] == [[0, 1], [2, 3]] and meta["dims"] == ["dp", "tp"]
    assert [p[0] for p in meta["placements"]] == ["strided_shard", "shard"]
