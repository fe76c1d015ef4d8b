"""torchrun's documented command lines, with ``torchrun`` replaced by ``cfrun`` (issue 27, item 1).

The list comes from ``torchrun --help`` and the PyTorch elastic docs ("torchrun (Elastic
Launch)": single-node multi-worker, stacked single-node, fault tolerant, elastic, static
rendezvous). Each either resolves (``cfrun --dry-run``: the config and the launch command,
nothing started) or is refused in one line ``drop X: cfrun does it because ...`` with exit 2.
One line runs for real, to show that the accepted flags reach a working job."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from conftest import SCRIPTS, cfrun_in_process, run_cfrun

pytestmark = [pytest.mark.timeout(240), pytest.mark.launched]  # as users launch

ACCEPTED = [
    # single node, multi worker
    "torchrun --standalone --nnodes=1 --nproc-per-node=2 train.py",
    "torchrun --standalone --nnodes=1 --nproc_per_node=2 train.py --arg1",
    "torchrun --nproc-per-node=auto train.py",
    # stacked single node: each job on its own port
    "torchrun --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --nnodes=1 --nproc-per-node=2 "
    "train.py",
    "torchrun --nnodes=1 --nproc-per-node=2 --master-port=29501 train.py",
    # fault tolerant, fixed size
    "torchrun --nnodes=2 --nproc-per-node=4 --max-restarts=3 --rdzv-id=100 "
    "--rdzv-backend=c10d --rdzv-endpoint=host:29400 train.py",
    "torchrun --nnodes=2:2 --nproc-per-node=4 --rdzv-id=100 --rdzv-backend=c10d "
    "--rdzv-endpoint=host:29400 --rdzv-conf=timeout=900 train.py",
    # static rendezvous (torchrun's older multi-node form)
    "torchrun --nnodes=2 --node-rank=1 --nproc-per-node=4 --master-addr=10.0.0.1 "
    "--master-port=1234 train.py",
    "torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --rdzv-backend=static "
    "--master_addr=10.0.0.1 --master_port=1234 train.py",
]

REFUSED = [
    ("torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 --rdzv-id=1 "
     "--rdzv-backend=c10d --rdzv-endpoint=host:29400 train.py", "the range of --nnodes"),
    ("torchrun --standalone --nproc-per-node=2 --tee=3 train.py", "--tee"),
    ("torchrun --nproc-per-node=2 --log-dir=/tmp/logs train.py", "--log-dir"),
    ("torchrun --nproc-per-node=2 --redirects 3 train.py", "--redirects"),
    ("torchrun --nproc-per-node=2 -r 3 -t 3 train.py", "-r"),
    ("torchrun --monitor-interval=1 train.py", "--monitor-interval"),
    ("torchrun --role trainer train.py", "--role"),
    ("torchrun --no-python train.py", "--no-python"),
    ("torchrun --run-path train.py", "--run-path"),
    ("torchrun --start-method=spawn train.py", "--start-method"),
]

MODULE_LINES = [  # torchrun's -m/--module: the script argument is a module name (issue 34)
    "torchrun --standalone -m train",
    "torchrun --standalone --nproc-per-node=2 --module train --arg1",
]


def _as_cfrun(line: str) -> list[str]:
    words = shlex.split(line)
    assert words[0] == "torchrun"
    return words[1:]


@pytest.fixture()
def cwd(tmp_path):
    (tmp_path / "train.py").write_text((SCRIPTS / "print_argv.py").read_text())
    return tmp_path


@pytest.mark.parametrize("line", ACCEPTED)
@pytest.mark.parametrize("launcher", [[], ["--launcher", "torchrun"]], ids=["default", "torchrun"])
def test_torchrun_line_resolves(line, launcher, cwd):
    run = cfrun_in_process(["--dry-run", *launcher, *_as_cfrun(line)], cwd=cwd)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    launch = doc["launch"]
    script_at = launch.index(str(cwd / "train.py"))
    nnodes = 2 if "--nnodes=2" in line else 1
    if nnodes == 1 and not launcher:  # the default on one node: cfrun starts each rank
        assert launch[:script_at] == [sys.executable] and doc["config"]["launcher"] == "local"
    elif nnodes == 1:
        assert "--standalone" in launch[:script_at]  # cfrun's one-node rendezvous, its port
    else:
        assert f"--nnodes={nnodes}" in launch[:script_at] and \
            "--rdzv-backend=c10d" in launch[:script_at]
        endpoint = "host:29400" if "host:29400" in line else "10.0.0.1:1234"
        assert f"--rdzv-endpoint={endpoint}" in launch[:script_at]
    if "--arg1" in line:
        assert launch[script_at + 1:] == ["--arg1"]
    # a rendezvous option a one-node job does not use is named once, at INFO
    given = [w.split("=")[0].replace("_", "-") for w in shlex.split(line)
             if w.startswith(("--master", "--rdzv-endpoint", "--rdzv_endpoint"))]
    said = [l for l in run.stderr.splitlines() if "not used on one node" in l]
    if nnodes == 1 and given:
        assert len(said) == 1 and all(f"{flag} " in said[0] for flag in given), run.stderr
    else:
        assert not said, run.stderr


@pytest.mark.parametrize("line", MODULE_LINES)
def test_torchrun_module_line_resolves(line, cwd):
    run = cfrun_in_process(["--dry-run", *_as_cfrun(line)], cwd=cwd)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["config"]["module"] == "train"
    assert doc["config"]["script"] == str((cwd / "train.py").resolve())
    launch = doc["launch"]  # the default on one node: each rank is python -m MODULE
    assert launch == [sys.executable, "-m", "train", *(["--arg1"] if "--arg1" in line else [])]


@pytest.mark.parametrize(("line", "flag"), REFUSED)
def test_torchrun_line_refused_in_one_line(line, flag, cwd):
    run = cfrun_in_process(_as_cfrun(line), cwd=cwd)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"cfrun: error: drop {flag}"), lines[0]
    assert not (cwd / "cfrun-jobs").exists()  # nothing created


def test_nproc_per_node_gpu_without_a_gpu(cwd):
    """torchrun refuses ``gpu`` on a machine without one; so does cfrun (auto: the CPUs)."""
    import os

    from cfrun.contract.cluster import visible_gpu_count

    if visible_gpu_count():
        pytest.skip("this machine has a GPU")
    run = cfrun_in_process(["--nproc-per-node", "gpu", "train.py"], cwd=cwd)
    assert run.returncode == 2 and "no GPU is visible" in run.stderr, run.stderr
    run = cfrun_in_process(["--dry-run", "--nproc-per-node", "auto", "train.py"], cwd=cwd)
    assert json.loads(run.stdout)["config"]["nproc_per_node"] == os.cpu_count()


def test_a_pasted_torchrun_line_runs(tmp_path):
    """A real run of a pasted single-node line: the accepted flags reach a working job."""
    run = run_cfrun(["--standalone", "--nnodes=1", "--nproc_per_node=1", "--max-restarts=3",
                     "--master-port=29555", "--rdzv-backend=c10d", "--job-dir", "j",
                     str(SCRIPTS / "train_argv.py"), "--steps", "4"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert 'ARGV ["--steps", "4"]' in run.stdout and "FINAL" in run.stdout
