"""``cfrun -m MODULE`` (issue 34, item 3): a package module with relative imports, run as
``python -m pkg.train`` runs it, killed and resumed on one rank and on two, ends bit-identical to
the plain ``python -m`` run; an unknown module is refused in one line, nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_bit_identical, final_line, plain_run, run_cfrun

pytestmark = pytest.mark.timeout(400)

MODEL = """\
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)
"""

TRAIN = """\
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from .model import Net

assert __name__ == "__main__" and __package__ == "pkg" and __spec__.name == "pkg.train"
assert sys.path[0] == os.getcwd(), sys.path[:2]  # python -m: the working directory first

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
args = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
torch.manual_seed(0)
torch.set_num_threads(1)
g = torch.Generator().manual_seed(1)
x = torch.randn(256, 8, generator=g)
y = torch.randint(0, 3, (256,), generator=g)
ds = TensorDataset(x, y)
model = Net()
if world > 1:
    sampler = DistributedSampler(ds, shuffle=True, seed=2)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, drop_last=True)
    model = torch.nn.parallel.DistributedDataParallel(model)
else:
    sampler = None
    loader = DataLoader(ds, batch_size=16, shuffle=True, drop_last=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
seen, total = 0, 0.0  # progress kept in the module's own variables
for epoch in range(args.epochs):
    if sampler is not None:
        sampler.set_epoch(epoch)
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += len(xb)
        total += loss.item()
rank = int(os.environ.get("RANK", "0"))
if rank == 0:
    net = model.module if world > 1 else model
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, args.out)
    print(f"FINAL seen {seen} total {total!r}", flush=True)
if world > 1:
    dist.destroy_process_group()
"""


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """``pkg/`` in ``tmp_path``: ``pkg.train`` imports ``Net`` from ``.model`` (a relative
    import: ``python pkg/train.py`` cannot run it)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(MODEL)
    (pkg / "train.py").write_text(TRAIN)
    return tmp_path


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_module_run_one_rank_killed_resumes_bit_identical(package: Path) -> None:
    """``cfrun --interval 5 --inject-crash 23@0 -m pkg.train``: rank 0 SIGKILLed after step 23
    (epoch 1 of 3, 16 steps each), restarted from a checkpoint, ends as ``python -m pkg.train``
    does: the weights, the optimizer and the module's own running sums."""
    ref = plain_run(["-m", "pkg.train", "--out", "ref.pt"], package)
    got = run_cfrun(["--interval", "5", "--job-dir", "j", "--inject-crash", "23@0",
                     "-m", "pkg.train", "--out", "got.pt"], cwd=package)
    assert got.returncode == 0, got.stderr[-4000:]
    [resumed] = {e["step"] for e in got.events("resumed")}
    assert 5 <= resumed <= 23
    assert_bit_identical(_state(package / "ref.pt"), _state(package / "got.pt"))
    assert final_line(got.stdout) == final_line(ref.stdout)
    assert not got.events("not_exact") and not got.events("unprotected"), got.events()
    config = json.loads((package / "j" / "config.json").read_text())
    assert config["module"] == "pkg.train"
    assert config["script"] == str((package / "pkg" / "train.py").resolve())
    identity = json.loads((package / "j" / "identity.json").read_text())
    assert identity["module"] == "pkg.train" and identity["script"] == config["script"]
    status = run_cfrun(["status", "j", "--json"], cwd=package)
    assert json.loads(status.stdout)["module"] == "pkg.train", status.stderr


@pytest.mark.slow  # -m killed and resumed: the one-rank test above; two ranks: its own kind
@pytest.mark.torchrun
def test_module_run_two_ranks_killed_then_cfrun_resume_bit_identical(package: Path) -> None:
    """``--nproc-per-node 2 -m pkg.train`` under torchrun (its own ``--module``), gloo, DDP, a
    DistributedSampler: rank 0 SIGKILLed after step 13 with no restarts left (exit 4), then
    ``cfrun resume JOBDIR`` ends as ``torchrun --nproc-per-node 2 -m pkg.train`` does."""
    ref = plain_run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     "-m", "pkg.train", "--out", "ref.pt"], package)
    common = ["--nproc-per-node", "2", "--interval", "5", "--job-dir", "j"]
    first = run_cfrun([*common, "--inject-crash", "13@0", "--max-restarts", "0",
                       "-m", "pkg.train", "--out", "got.pt"], cwd=package)
    assert first.returncode == 4, first.stderr[-4000:]
    assert not (package / "got.pt").exists()
    got = run_cfrun(["resume", "j"], cwd=package)
    got.job_dir = package / "j"
    assert got.returncode == 0, got.stderr[-4000:]
    assert "cfrun: resuming: -m pkg.train --out got.pt" in got.stderr, got.stderr[-3000:]
    [resumed] = {e["step"] for e in got.events("resumed")}  # both ranks, the same step
    assert 5 <= resumed <= 13
    assert_bit_identical(_state(package / "ref.pt"), _state(package / "got.pt"))
    assert final_line(got.stdout) == final_line(ref.stdout)


def test_an_edited_module_is_a_changed_command(package: Path) -> None:
    """The module's file is hashed like a script's: edited after a checkpoint, a resume is
    refused (exit 2) instead of going on silently."""
    first = run_cfrun(["--interval", "5", "--job-dir", "j", "--inject-crash", "23@0",
                       "--max-restarts", "0", "-m", "pkg.train", "--out", "got.pt"],
                      cwd=package)
    assert first.returncode == 4, first.stderr[-4000:]
    train = package / "pkg" / "train.py"
    train.write_text(train.read_text().replace("lr=0.05", "lr=0.04"))
    again = run_cfrun(["--job-dir", "j", "-m", "pkg.train", "--out", "got.pt"], cwd=package)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "script edited" in again.stderr, again.stderr[-3000:]
    assert not (package / "got.pt").exists()


@pytest.mark.parametrize("flag", ["-m", "--module"])
def test_an_unknown_module_is_refused_in_one_line(package: Path, flag: str) -> None:
    """A module that is not found: one line naming it and the fix, exit 2 (bad input), no job
    dir; nothing of the package ran (its ``__init__`` would have left a file)."""
    (package / "pkg" / "__init__.py").write_text("open('init-ran', 'w').close()\n")
    run = run_cfrun([flag, "pkg.trian", "--out", "x.pt"], cwd=package)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("cfrun: error: -m 'pkg.trian': no module 'pkg.trian' found"), \
        lines[0]
    assert "cfrun -m pkg.train" in lines[0]  # the fix
    assert not (package / "cfrun-jobs").exists() and not (package / "init-ran").exists()


def test_module_spellings_resolve_without_running_it(package: Path) -> None:
    """``-m pkg.train``, ``--module pkg.train``, ``-mpkg.train`` and ``--module=pkg.train``
    (``cfrun --dry-run``): the module's file recorded, the module's name in the job dir's name,
    each rank's ``python -m pkg.train`` in the launch (the one-node default, cfrun's own
    launcher), torchrun's ``--module`` under ``--launcher torchrun``; ``--launcher python``:
    ``python -m pkg.train``. Words after the module are the script's, ``-m`` among them."""
    for words in (["-m", "pkg.train"], ["--module", "pkg.train"], ["-mpkg.train"],
                  ["--module=pkg.train"]):
        for launcher, launch in (("auto", [sys.executable, "-m"]), ("torchrun", ["--module"])):
            run = run_cfrun(["--dry-run", "--launcher", launcher, "--nproc-per-node", "2", *words,
                             "--out", "o", "-m"], cwd=package)
            assert run.returncode == 0, run.stderr
            doc = json.loads(run.stdout)
            assert doc["config"]["module"] == "pkg.train"
            assert doc["config"]["script"] == str((package / "pkg" / "train.py").resolve())
            assert Path(doc["config"]["job_dir"]).name.startswith("pkg.train-")
            assert doc["launch"][-4 - len(launch):] == [*launch, "pkg.train", "--out", "o", "-m"]
    run = run_cfrun(["--dry-run", "--launcher", "python", "-m", "pkg.train", "--out", "o"],
                    cwd=package)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["launch"] == [sys.executable, "-m", "pkg.train", "--out", "o"]
    assert not (package / "cfrun-jobs").exists()
