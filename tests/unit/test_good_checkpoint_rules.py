"""Good checkpoints in-process: retention counts only good ones, a resume judges every rank's
tree alike and moves bad ones aside with their reason, check_fits names the first difference.
The same behaviour as real runs: tests/integration/test_good_checkpoints.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cfrun.codec.checkpoint import (
    JobMismatchError,
    RankLoadError,
    apply_retention,
    check_fits,
    commit,
    committed_steps,
    good_steps,
    load_newest,
    quarantine,
    staging_dir,
    write_shard,
)
from cfrun.codec.format import encode
from cfrun.contract.jobdir import step_dir_name
from cfrun.contract.manifest import MANIFEST


def _save(ckpts: Path, step: int, state: Any = None, *, ranks: int = 1) -> Path:
    files = []
    for rank in range(ranks):
        tensors: list[torch.Tensor] = []
        tree = encode(state if state is not None else {"w": torch.full((3,), float(step))},
                      tensors)
        files += write_shard(staging_dir(ckpts, step), rank, tree, tensors, {"step": step})
    return commit(ckpts, step, files, world_size=ranks, meta={"step": step}, keep=None)


def _foreign(ckpts: Path, step: int) -> None:
    d = _save(ckpts, step)
    m = json.loads((d / MANIFEST).read_text())
    m["format_version"] = 2
    (d / MANIFEST).write_text(json.dumps(m))


def test_retention_counts_only_good_steps_and_keeps_the_newest_good(tmp_path: Path) -> None:
    ckpts = tmp_path / "c"
    for step in (10, 20, 30):
        _save(ckpts, step)
    _foreign(ckpts, 900)
    _foreign(ckpts, 901)
    (_save(ckpts, 25) / "rank-00000.bin").unlink()  # a missing file: not good either
    assert good_steps(ckpts) == [30, 20, 10]
    assert apply_retention(ckpts, 2) == [10]
    assert committed_steps(ckpts) == [901, 900, 30, 25, 20]  # not good: neither counted nor deleted
    assert apply_retention(ckpts, 0) == [20]  # the newest good one stays whatever keep says
    assert good_steps(ckpts) == [30]


def test_moved_aside_with_reason_and_never_counted_again(tmp_path: Path) -> None:
    ckpts = tmp_path / "c"
    _save(ckpts, 10)
    _foreign(ckpts, 20)
    _save(ckpts, 30)
    (ckpts / step_dir_name(30) / "rank-00000.bin").write_bytes(b"x" * 4096)
    skipped: list[int] = []
    got = load_newest(ckpts, 0, on_skip=lambda step, e: skipped.append(step))
    assert got is not None and got[0] == 10
    assert skipped == [30, 20]
    names = sorted(p.name if p.name.startswith("step-") else p.name.rsplit("-", 1)[0]
                   for p in ckpts.iterdir())
    assert names == ["corrupt-step-000030", "incompatible-step-000020", "step-000010"]
    assert committed_steps(ckpts) == good_steps(ckpts) == [10]
    assert quarantine(ckpts, 30) is None  # a second rank's move: already done, no error
    with pytest.raises(ValueError, match="reason"):
        quarantine(ckpts, 10, "whatever")


def test_a_tree_that_fails_the_state_check_on_any_rank_is_skipped_by_every_rank(
        tmp_path: Path) -> None:
    """Rank 1's tree lacks a key the resume needs: rank 0, whose own tree is fine, falls back
    too (each rank checks every rank's tree, on meta tensors)."""
    ckpts = tmp_path / "c"
    _save(ckpts, 10, {"w": torch.ones(2), "data": 1}, ranks=2)
    files = []
    for rank, state in enumerate(({"w": torch.ones(2), "data": 2}, {"w": torch.ones(2)})):
        tensors: list[torch.Tensor] = []
        files += write_shard(staging_dir(ckpts, 20), rank, encode(state, tensors), tensors, {})
    commit(ckpts, 20, files, world_size=2, meta={}, keep=None)

    def check(state: Any, meta: dict[str, Any]) -> None:
        assert state["w"].device.type == "meta"
        state["data"]  # noqa: B018  (a KeyError on rank 1's tree)

    got = load_newest(ckpts, 0, check_state=check, world_size=2)
    assert got is not None and got[0] == 10 and got[1]["data"] == 1
    assert committed_steps(ckpts) == [10]


def test_an_own_shard_that_fails_after_the_checks_is_a_rank_load_error(tmp_path: Path,
                                                                       monkeypatch) -> None:
    ckpts = tmp_path / "c"
    _save(ckpts, 10)
    import cfrun.codec.checkpoint as cc

    def broken(*args: Any) -> Any:  # the read of the own shard's bytes (ShardRead)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(cc, "_stream_into", broken)
    with pytest.raises(RankLoadError, match="step 10.*OSError"):
        load_newest(ckpts, 0)
    assert committed_steps(ckpts) == [10]  # the caller moves it aside and restarts


@pytest.mark.parametrize("ranks,bad", [(1, 0), (2, 1)])
def test_a_corrupt_own_shard_is_read_once_and_every_rank_falls_back_to_the_same_step(
        tmp_path: Path, monkeypatch, ranks: int, bad: int) -> None:
    """check_usable leaves the loading rank's own .bin to the load, which checksums it as it
    streams (one read, not two); a flipped byte there is still a verdict: every rank, the one
    that owns the file included, skips the step and loads the same older one."""
    ckpts = tmp_path / "c"
    _save(ckpts, 10, ranks=ranks)
    step_dir = _save(ckpts, 20, ranks=ranks)
    import cfrun.contract.manifest as cm

    checked: list[str] = []
    real_check = cm.Manifest.check_file
    monkeypatch.setattr(cm.Manifest, "check_file",
                        lambda self, d, name: (checked.append(name), real_check(self, d, name)))
    got = load_newest(ckpts, 0, world_size=ranks)
    assert got is not None and got[0] == 20
    assert "rank-00000.bin" not in checked and len(checked) == 2 * ranks - 1
    bin_path = step_dir / f"rank-{bad:05d}.bin"
    raw = bytearray(bin_path.read_bytes())
    raw[-1] ^= 0xFF
    bin_path.write_bytes(bytes(raw))
    got = [load_newest(ckpts, r, world_size=ranks) for r in range(ranks)]
    assert [g[0] for g in got if g is not None] == [10] * ranks
    assert all(torch.equal(g[1]["w"], torch.full((3,), 10.0)) for g in got if g is not None)
    assert committed_steps(ckpts) == [10]


def _job(width: int = 4, groups: int = 1, sched: str = "step") -> tuple[Any, ...]:
    model = nn.Sequential(nn.Linear(3, width), nn.Linear(width, 1))
    params: list[dict[str, Any]] = ([{"params": list(model.parameters())}] if groups == 1 else
                                    [{"params": list(model[0].parameters())},
                                     {"params": list(model[1].parameters())}])
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    s: Any = (torch.optim.lr_scheduler.StepLR(opt, 1) if sched == "step" else
              torch.optim.lr_scheduler.ExponentialLR(opt, 0.9))
    return model, opt, s


def _state_of(model: Any, opt: Any, sched: Any) -> dict[str, Any]:
    return {"modules": [model.state_dict()], "optimizers": [opt.state_dict()],
            "schedulers": [sched.state_dict()], "scalers": []}


@pytest.mark.parametrize("live, needle", [
    ({"width": 5}, "model 0 (Sequential).0.weight is float32 [4, 3] in the checkpoint, "
                   "float32 [5, 3] live"),
    ({"groups": 2}, "optimizer 0 (SGD) has 1 parameter groups in the checkpoint, 2 live"),
    ({"sched": "exp"}, "LR scheduler 0 (ExponentialLR): step_size only in the checkpoint"),
])
def test_check_fits_names_the_first_difference(live: dict[str, Any], needle: str) -> None:
    saved = _state_of(*_job())
    check_fits(saved, *[[x] for x in _job()], [])  # the same job fits
    model, opt, sched = _job(**live)
    with pytest.raises(JobMismatchError) as err:
        check_fits(saved, [model], [opt], [sched], [])
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_check_fits_refuses_a_layer_only_on_one_side() -> None:
    saved = _state_of(*_job())
    bigger = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1), nn.Linear(1, 1))
    _, opt, sched = _job()
    with pytest.raises(JobMismatchError, match=r"2\.weight is in the live job, not in the "):
        check_fits(saved, [bigger], [opt], [sched], [])
