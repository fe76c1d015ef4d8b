"""cfrun under SLURM, simulated: two "nodes" (two cfrun processes, as ``srun`` starts one per
node) with only SLURM's variables to go on; a time-limit SIGTERM to every node, then the
requeued job's same command on both nodes, bit-identical to one node with two ranks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_bit_identical, clean_env, ddp_reference
from test_multinode import free_port, saved

from cfrun.contract import faults

pytestmark = [pytest.mark.timeout(420), pytest.mark.launched]  # as users launch


def _srun_node(tmp_path: Path, node: int, port: int, job_id: str) -> subprocess.Popen[str]:
    # 0.1 s a step (cfrun's hook sleeps; the reference computes the same): the SIGTERM must
    # land while the script trains, not after its 69 steps (0.6 s under load once: the job
    # had finished, and a signal after the script's end is a success)
    env = clean_env({"SLURM_JOB_ID": job_id, "SLURM_NNODES": "2", "SLURM_NODEID": str(node),
                     "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(port),
                     **faults.arm({}, **{"rank.step_delay_s": 0.1})})
    argv = [sys.executable, "-m", "cfrun", "--interval", "10", "--job-dir", "job",
            str(SCRIPTS / "train_ddp.py"), f"got{node}.pt"]
    return subprocess.Popen(argv, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.slow
def test_slurm_variables_place_the_nodes_and_a_requeue_after_sigterm_resumes(tmp_path,
                                                                              tmp_path_factory):
    _, ref_state = ddp_reference(tmp_path_factory)  # one node, two ranks, --interval 10
    job = tmp_path / "job"
    port = free_port()
    nodes = [_srun_node(tmp_path, n, port, "987654") for n in (0, 1)]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # the time limit comes once a rank is past step 25
        beats = [int(t) for p in job.glob("heartbeat-rank-*") if (t := p.read_text().strip())]
        if beats and max(beats) >= 25:
            break
        assert all(p.poll() is None for p in nodes)
        time.sleep(0.02)
    for p in nodes:  # SLURM signals every step of the job (#SBATCH --signal=TERM@60)
        p.send_signal(signal.SIGTERM)
    for p in nodes:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 75, err[-3000:]
    assert "from the environment: nnodes 2 (SLURM_NNODES)" in err
    for node, name in ((0, "config.json"), (1, "config-node1.json")):
        config = json.loads((job / name).read_text())
        assert (config["nnodes"], config["node_rank"]) == (2, node)
        assert config["rdzv_endpoint"] == f"localhost:{port}"
        assert config["rdzv_id"] == "slurm-987654"
    events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]
    finals = [e["final_checkpoint"] for e in events if e["event"] == "preempted"]
    assert finals and all(f is not None for f in finals), finals
    # the requeued job: the same commands, SLURM's variables again (the same job id)
    nodes = [_srun_node(tmp_path, n, port, "987654") for n in (0, 1)]
    for p in nodes:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]
    resumed = {e["step"] for e in events if e["event"] == "resumed"}
    assert resumed == {max(finals)}, (resumed, finals)
    assert_bit_identical(ref_state, saved(tmp_path, "got"))


@pytest.mark.parametrize(("flags", "env", "nproc"), [
    ([], {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1"}, 2),  # a PyTorchJob's worker pod
    (["--nproc-per-node", "1"], {"PET_NPROC_PER_NODE": "2"}, 1),  # a flag beats PET_*
    ([], {"PET_NPROC_PER_NODE": "2", "CFRUN_NPROC_PER_NODE": "1"}, 1),  # so does CFRUN_*
])
def test_torchrun_pet_variables_are_defaults_that_flags_beat(tmp_path, flags, env, nproc):
    run = subprocess.run([sys.executable, "-m", "cfrun", *flags, "--job-dir", "j",
                          str(SCRIPTS / "print_argv.py"), "x"], cwd=tmp_path,
                         env=clean_env(env), text=True, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "j" / "config.json").read_text())["nproc_per_node"] == nproc
    assert run.stdout.count("ARGV") == nproc  # one line per rank
