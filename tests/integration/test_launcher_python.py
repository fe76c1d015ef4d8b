"""``--launcher python``: one process run as ``python script.py`` would be (no RANK,
WORLD_SIZE, MASTER_* in its environment), still checkpointed, supervised and resumable; with
``--nproc-per-node N`` cfrun starts the ranks itself with torchrun's environment."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    SCRIPTS,
    Run,
    assert_bit_identical,
    clean_env,
    job_events,
    plain_run,
    run_cfrun,
    shared_run,
)

from cfrun.contract.config import Command, RunConfig

pytestmark = pytest.mark.timeout(300)
PLAIN = str(SCRIPTS / "train_plain_only.py")
STEPS = "40"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The script run as plain ``python script.py``: its final model and optimizer; run once
    per session (:func:`shared_run`: a module fixture runs once per xdist worker)."""
    def make(cwd: Path) -> Run:
        p = plain_run([PLAIN, STEPS, "ref.pt", "0"], cwd)
        return Run(p.returncode, p.stdout, p.stderr, cwd)

    run = shared_run(tmp_path_factory, "plain-only-40", make)
    return torch.load(Path(run.cwd or "") / "ref.pt", weights_only=True)


@pytest.mark.launched  # the default launcher is the point
def test_under_torchrun_the_script_refuses_to_run(tmp_path):
    """Why the option exists: the default launcher sets RANK as torchrun does, and this script
    fails on it."""
    run = run_cfrun(["--crash-loop", "1", "--max-restarts", "0", "--job-dir", "j", PLAIN,
                     STEPS, "out.pt", "0"], cwd=tmp_path)
    assert run.returncode != 0
    assert "launched as a distributed rank" in run.stderr + run.stdout


@pytest.mark.slow
def test_crash_resumes_bit_identical_to_plain_python(reference, tmp_path):
    run = run_cfrun(["--launcher", "python", "--interval", "5", "--inject-crash", "12",
                     "--job-dir", "j", PLAIN, STEPS, "out.pt", "0"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    starts = run.events("attempt_start")
    assert len(starts) == 2, run.stderr[-3000:]  # the injected crash restarted it
    assert all("torch.distributed.run" not in s["argv"] for s in starts)
    assert starts[0]["argv"][1:] == [PLAIN, STEPS, "out.pt", "0"]
    [resumed] = run.events("resumed")
    assert 0 < resumed["step"] <= 12
    assert run.events("checkpoint")
    assert_bit_identical(reference, torch.load(tmp_path / "out.pt", weights_only=True))
    cfg = (tmp_path / "j" / "config.json").read_text()
    assert '"launcher": "python"' in cfg


@pytest.mark.slow
def test_env_variable_selects_it(reference, tmp_path):
    run = run_cfrun(["--interval", "10", "--job-dir", "j", PLAIN, STEPS, "out.pt", "0"],
                    cwd=tmp_path, env={"CFRUN_LAUNCHER": "python"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert_bit_identical(reference, torch.load(tmp_path / "out.pt", weights_only=True))


@pytest.mark.slow
def test_sigterm_preempts_with_exit_75_then_resume_finishes(reference, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "cfrun", "--launcher", "python",
                             "--interval", "5", "--job-dir", "j", PLAIN, STEPS, "out.pt",
                             "0.1"], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    hb = tmp_path / "j" / "heartbeat-rank-00000"
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "step 8 not reached"
        try:
            if int(hb.read_text().strip() or 0) >= 8:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    first = Run(proc.returncode, out, err, tmp_path / "j")
    assert first.returncode == 75, err[-3000:]
    [pre] = first.events("preempted")
    assert pre["final_checkpoint"] == pre["step"] >= 8
    assert not (tmp_path / "out.pt").exists()
    run = run_cfrun(["resume", "j"], cwd=tmp_path)
    run.job_dir = tmp_path / "j"
    assert run.returncode == 0, run.stderr[-3000:]
    assert [e["step"] for e in run.events("resumed")] == [pre["step"]]
    assert_bit_identical(reference, torch.load(tmp_path / "out.pt", weights_only=True))


@pytest.mark.parametrize("extra", [["--nnodes", "2", "--rdzv-endpoint", "localhost:29999"],
                                   ["--nproc-per-node", "2", "--nnodes", "2",
                                    "--rdzv-endpoint", "localhost:29999"]])
def test_several_nodes_are_refused_in_one_line(tmp_path, extra):
    """cfrun starts the ranks of one node itself (several ranks run:
    test_standby.py); several nodes need torchrun's rendezvous: one line naming the value and
    the fix, nothing made."""
    run = run_cfrun(["--launcher", "python", *extra, "--job-dir", "j", PLAIN, STEPS, "o.pt",
                     "0"], cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cfrun: error:"), run.stderr
    assert "--launcher python" in lines[0] and "--nnodes 2" in lines[0], lines
    assert not (tmp_path / "j").exists()
    assert list(tmp_path.iterdir()) == []


def test_unknown_launcher_is_refused(tmp_path):
    run = run_cfrun(["--launcher", "mpirun", "--job-dir", "j", PLAIN, STEPS, "o.pt", "0"],
                    cwd=tmp_path)
    assert run.returncode == 2 and "--launcher 'mpirun'" in run.stderr
    assert not (tmp_path / "j").exists()


def test_launcher_is_not_part_of_the_command(tmp_path):
    """Changing it between runs of a job is no changed command (identity.json)."""
    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    base = dict(script=str(script), script_args=["a"], job_dir=str(tmp_path / "j"),
                cwd=str(tmp_path))
    python = Command.of(RunConfig(**base, launcher="python"))  # type: ignore[arg-type]
    torchrun = Command.of(RunConfig(**base))  # type: ignore[arg-type]
    assert python.fingerprint == torchrun.fingerprint


DDP_WHEN_RANK = str(SCRIPTS / "ddp_when_rank.py")
"""nanoGPT's start: ``init_process_group("nccl")`` whenever ``RANK`` is set (issue 37)."""
needs_no_nccl = pytest.mark.skipif(torch.distributed.is_nccl_available()
                                   and torch.cuda.is_available(),
                                   reason="NCCL works here: the script goes DDP and trains")


@needs_no_nccl
@pytest.mark.parametrize("launcher, who", [("auto", "cfrun, as torchrun does,"),
                                           ("torchrun", "torchrun")])
def test_a_script_that_goes_distributed_stops_at_once_with_the_python_line(
        tmp_path, launcher, who):
    """Under the one-node default (cfrun's launcher, torchrun's variables) and under torchrun
    a one-rank job's script sees RANK and sets up NCCL, which this machine lacks: one attempt
    (it fails the same way every time), and the hint is the command as typed with --launcher
    python, which then trains."""
    typed = ["--interval", "5", "--job-dir", "j", DDP_WHEN_RANK, "20", "out.pt"]
    run = run_cfrun(typed, cwd=tmp_path, env={"CFRUN_LAUNCHER": launcher})
    assert run.returncode == 5, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == 1
    [error] = [line for line in run.stderr.splitlines() if line.startswith("cfrun: error:")]
    assert f"went distributed because {who} set RANK" in error
    assert "NCCL" in error and "--launcher python" in error
    [hint] = [line for line in run.stderr.splitlines() if line.startswith("hint:")]
    line = hint.rpartition(": ")[2]
    assert line == shlex.join(["cfrun", "--launcher", "python", *typed])
    again = run_cfrun(shlex.split(line)[1:], cwd=tmp_path)  # the hint does what it says
    assert again.returncode == 0, again.stderr[-3000:]
    assert "FINAL done" in again.stdout and (tmp_path / "out.pt").exists()


@needs_no_nccl
def test_profile_takes_the_launcher(tmp_path):
    run = run_cfrun(["profile", "--launcher", "python", "--job-dir", "p", DDP_WHEN_RANK, "2000",
                     "out.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "chosen interval" in run.stdout
    assert all("torch.distributed.run" not in s["argv"] for s in run.events("attempt_start"))


@needs_no_nccl
@pytest.mark.slow
def test_verify_takes_the_launcher(tmp_path):
    run = run_cfrun(["verify", "--launcher", "python", "--steps", "12", "--interval", "5",
                     "--kills", "1", DDP_WHEN_RANK, "40", "out.pt"], cwd=tmp_path,
                    env={"TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "exact:" in run.stdout


@pytest.mark.parametrize("nproc, launcher", [
    (1, None),
    pytest.param(2, None, marks=pytest.mark.slow),
    # tests/unit/test_local_ranks.py checks it against torch's source, quickly
    pytest.param(2, "python", marks=pytest.mark.extended)],
    ids=["default-1", "default-2", "python-2"])
def test_the_ranks_see_the_environment_torchrun_standalone_gives_its_ranks(
        tmp_path, nproc, launcher):
    """The one-node default (``local``: no ``--launcher``, no ``CFRUN_LAUNCHER``), one rank or
    two, and ``--launcher python --nproc-per-node 2``: each rank's whole environment equals
    what the plain ``torchrun --standalone --nproc-per-node N`` gives its rank, but for cfrun's
    own marks and hooks, the per-run values (port, run id) and the two differences on purpose
    (no agent store, no torchrun error file or signal list: cfrun.supervisor.launcher's
    local_rank_env); OMP_NUM_THREADS is 1 in both when unset with two ranks, and unset in both
    with one. Both join gloo and train; no torchrun runs under cfrun."""
    probe = str(SCRIPTS / "dist_env_probe.py")
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", str(nproc), probe, "plain"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=240)
    # torch 2.13 with gloo may abort a rank in C++ teardown after the script ended
    # (conftest.plain_run): the run is complete when both ranks printed their last line
    torn_down = "terminate called without an active exception" in plain.stderr \
        and plain.stdout.count("FINAL done") == nproc
    assert plain.returncode == 0 or torn_down, plain.stderr[-3000:]
    chosen = ["--launcher", launcher] if launcher else []
    got = subprocess.run([sys.executable, "-m", "cfrun", *chosen,
                          "--nproc-per-node", str(nproc), "--job-dir", "j", probe, "got"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.count("FINAL done") == nproc
    config = json.loads((tmp_path / "j" / "config.json").read_text())
    assert config["launcher"] == (launcher or "local")
    [start] = job_events(tmp_path / "j", "attempt_start")
    assert start["argv"][1:] == [probe, "got"], start  # the script itself: no torchrun
    for rank in range(nproc):
        want = json.loads((tmp_path / f"plain-{rank}.json").read_text())
        have = json.loads((tmp_path / f"got-{rank}.json").read_text())
        assert want.get("OMP_NUM_THREADS") == have.get("OMP_NUM_THREADS") == (
            "1" if nproc > 1 else None)
        assert have["RANK"] == have["LOCAL_RANK"] == str(rank)
        assert want.pop("TORCHELASTIC_USE_AGENT_STORE") == "True"
        assert have.pop("TORCHELASTIC_USE_AGENT_STORE") == "False"
        for name in ("TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
            want.pop(name)
        for name in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"):  # chosen per run
            assert want.pop(name) and have.pop(name)
        ours = {k for k in have if k.startswith("CFRUN_") or k == "PYTHONPATH"}
        assert {k: v for k, v in have.items() if k not in ours} == {
            k: v for k, v in want.items() if k != "PYTHONPATH" and not k.startswith("CFRUN_")}
