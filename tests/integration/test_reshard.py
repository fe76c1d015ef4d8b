"""A job resumes on another world size with ``--reshard`` (issue 25, item 4).

One script (``train_reshard.py``: 384 digits, a global batch of 32 split over the ranks, a
DistributedSampler, Adam), DDP or FSDP2: a 4-rank cfrun job is SIGKILLed, resumed on 2 ranks
with ``cfrun resume --reshard --nproc-per-node 2``, SIGKILLed again and resumed on 4. Checked:

* without ``--reshard`` the resume on 2 ranks is refused with exit 5 and one line naming the
  flag, and nothing in the job dir changes;
* it finishes, each reshard says so (a ``resharded`` event from and to, ``cfrun status``);
* every sample of each epoch is trained on exactly once over the final history (the steps the
  resumes redid replace the killed attempts' ones), counted from the indices each rank logs;
* the loss of every step equals the uninterrupted plain ``torchrun`` run's within float noise
  (the same global batch on any world size: only the reduction order differs), so the loss
  after each reshard goes on from the one before it; the final weights agree to 1e-5.

One plain 4-rank DDP run is the reference for both: FSDP2 computes the same sums.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, Run, clean_env, plain_run, run_cfrun, shared_run

from cfrun.contract import faults
from cfrun.contract.checkpoints import committed_steps
from cfrun.contract.jobdir import step_dir_name

# one xdist worker runs the module's tests (each runs 4 ranks at a time); its plain torchrun
# reference runs once per session (shared_run: a module fixture ran once per test under xdist)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.launched,
              pytest.mark.xdist_group("reshard")]

SCRIPT = str(SCRIPTS / "train_reshard.py")
SAMPLES, STEPS_PER_EPOCH, EPOCHS = 384, 12, 2
KILLS = "10@0,18@1"  # rank 0 SIGKILLed after step 10 (4 ranks), after step 18 (2 ranks)


def _resume(job: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cfrun", "resume", str(job), *args], cwd=cwd,
                          env=clean_env({"PYTHONPATH": str(SCRIPTS)}), capture_output=True,
                          text=True, timeout=400)


def _losses(stdout: str) -> dict[int, float]:
    """``{step: mean loss}`` of one run's rank 0 (a later line of a step wins)."""
    return {int(w[1]): float(w[3]) for w in (l.split() for l in stdout.splitlines())
            if w[:1] == ["loss"]}


def _seen(cwd: Path) -> dict[int, list[list[int]]]:
    """``{step: [indices of each rank]}`` as the steps finally ran: from the last run (of the
    ``seen-RUN-rankR.txt`` files the script writes) that trained each step."""
    by_run: dict[int, dict[int, list[list[int]]]] = {}
    for f in cwd.glob("seen-*-rank*.txt"):
        run = int(f.name.split("-")[1])
        for w in (l.split() for l in f.read_text().splitlines()):
            by_run.setdefault(run, {}).setdefault(int(w[0]), []).append(
                [int(i) for i in w[3].split(",")])
    out: dict[int, list[list[int]]] = {}
    for run in sorted(by_run):
        out.update(by_run[run])
    return out


def _assert_every_sample_once(cwd: Path, worlds: set[int]) -> None:
    """Every sample of each epoch trained on exactly once over the steps as they finally ran
    (:func:`_seen`), on each of the world sizes ``worlds``."""
    final = _seen(cwd)
    assert sorted(final) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    for epoch in range(EPOCHS):
        steps = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
        seen = sorted(i for s in steps for rank in final[s] for i in rank)
        assert seen == list(range(SAMPLES)), (epoch, len(seen), len(set(seen)))
    assert {len(ranks) for ranks in final.values()} == worlds, final.keys()


def _assert_follows_plain(stdouts: list[str], cwd: Path, plain: tuple[dict[int, float], Path]
                          ) -> None:
    """The loss of every step (the later run's line of a step wins) and the final weights
    equal the uninterrupted plain run's within 1e-5."""
    want, plain_weights = plain
    got: dict[int, float] = {}
    for stdout in stdouts:
        got.update(_losses(stdout))
    assert sorted(got) == sorted(want)
    for s in want:
        assert abs(got[s] - want[s]) < 1e-5, (s, got[s], want[s])
    mine, ref = torch.load(cwd / "got.pt"), torch.load(plain_weights)
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], rtol=0, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    """The uninterrupted reference: plain torchrun, 4 ranks, DDP; run once per session
    (:func:`shared_run`: this module's tests run on several xdist workers)."""
    def make(cwd: Path) -> Run:
        p = plain_run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                       SCRIPT, "ddp", "plain.pt"], cwd)
        return Run(p.returncode, p.stdout, p.stderr, cwd)

    p = shared_run(tmp_path_factory, "reshard4-plain", make)
    cwd = Path(p.cwd or "")
    losses = _losses(p.stdout)
    assert sorted(losses) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    return losses, cwd / "plain.pt"


@pytest.mark.parametrize("kind", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp2"])
def test_a_job_goes_4_to_2_to_4_ranks_with_every_sample_once(tmp_path, plain, kind):
    first = run_cfrun(["--nproc-per-node", "4", "--interval", "4", "--max-restarts", "0",
                       "--job-dir", "job", "--inject-crash", KILLS, SCRIPT, kind, "got.pt"],
                      cwd=tmp_path, env={"PYTHONPATH": str(SCRIPTS)}, timeout=400)
    assert first.returncode == 4, first.stderr[-3000:]  # killed, no restart left
    job = first.job_dir
    before = sorted(p.name for p in (job / "checkpoints").iterdir())
    assert any(n.startswith("step-") for n in before), before

    refused = _resume(job, tmp_path, "--nproc-per-node", "2")
    assert refused.returncode == 5, refused.stderr[-2000:]
    line = [l for l in refused.stderr.splitlines() if l.startswith("cfrun: error:")]
    assert len(line) == 1 and "--reshard" in line[0] and "4 ranks" in line[0], refused.stderr
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == before

    down = _resume(job, tmp_path, "--reshard", "--nproc-per-node", "2")
    assert down.returncode == 4, down.stderr[-3000:]  # the second kill, on 2 ranks
    assert "resharding checkpoint step" in down.stderr and "not bit-exact" in down.stderr
    up = _resume(job, tmp_path, "--reshard", "--nproc-per-node", "4")
    assert up.returncode == 0, up.stderr[-3000:]

    events = [json.loads(l) for l in (job / "events.jsonl").read_text().splitlines()]
    resharded = [(e["from_world_size"], e["to_world_size"]) for e in events
                 if e["event"] == "resharded"]
    assert resharded == [(4, 2), (2, 4)], resharded
    resumed = sorted({(e["attempt"], e["step"]) for e in events if e["event"] == "resumed"})
    assert [a for a, _ in resumed] == [1, 2] and all(s > 0 for _, s in resumed), resumed

    _assert_every_sample_once(tmp_path, {2, 4})  # steps ran on both world sizes
    # the loss goes on across each reshard as in the uninterrupted run
    _assert_follows_plain([first.stdout, down.stdout, up.stdout], tmp_path, plain)

    status = subprocess.run([sys.executable, "-m", "cfrun", "status", "--json", str(job)],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                            timeout=300)
    rows = json.loads(status.stdout)["resharded"]
    assert [(r["from_world_size"], r["to_world_size"]) for r in rows] == [(4, 2), (2, 4)]


def test_a_corrupt_shard_no_new_rank_takes_whole_falls_back_on_every_rank(tmp_path, plain):
    """The newest checkpoint of a 4-rank FSDP2 job has one flipped byte in old rank 3's shard,
    which no new rank of 2 takes whole (each takes old rank ``r % 4``'s, and new rank 1 only
    the overlapping DTensor shards of rank 3, lazily). A resume with ``--reshard`` still
    verifies every file: both new ranks fall back to the step before, the damaged step is
    moved aside (not deleted), and the job finishes with the loss of the uninterrupted plain
    run."""
    first = run_cfrun(["--nproc-per-node", "4", "--interval", "4", "--max-restarts", "0",
                       "--job-dir", "job", SCRIPT, "fsdp2", "got.pt"], cwd=tmp_path,
                      env=faults.arm({"PYTHONPATH": str(SCRIPTS)},
                                     **{"rank.kill_after_snapshot": 12}), timeout=400)
    assert first.returncode == 4, first.stderr[-3000:]  # every rank killed after step 12's handoff
    job = first.job_dir
    ckpts = job / "checkpoints"
    steps = committed_steps(ckpts)
    assert len(steps) >= 2, steps
    newest, previous = steps[0], steps[1]
    shard = ckpts / step_dir_name(newest) / "rank-00003.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.chmod(0o600)
    shard.write_bytes(bytes(data))

    down = _resume(job, tmp_path, "--reshard", "--nproc-per-node", "2")
    assert down.returncode == 0, down.stderr[-3000:]
    events = [json.loads(l) for l in (job / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "checkpoint_corrupt"] == [newest]
    resumed = [(e["rank"], e["step"]) for e in events
               if e["event"] == "resumed" and e["attempt"] > 0]
    assert sorted(resumed) == [(0, previous), (1, previous)], resumed
    assert [(e["from_world_size"], e["to_world_size"]) for e in events
            if e["event"] == "resharded"] == [(4, 2)]
    names = [p.name for p in ckpts.iterdir()]
    assert sum(n.startswith(f"corrupt-step-{newest:06d}-") for n in names) == 1, names
    assert min(committed_steps(ckpts)) > newest, names  # the resumed run committed (--keep 2)

    _assert_follows_plain([first.stdout, down.stdout], tmp_path, plain)


def test_a_two_node_job_lost_for_good_goes_on_on_one_node(tmp_path, plain):
    """Spot capacity gone: a 2-node job (one rank each, torchrun's c10d rendezvous on
    loopback) dies with rank 0 SIGKILLed and no restarts left, and goes on on the one node
    left with ``cfrun resume --reshard --nnodes 1 --nproc-per-node 1`` (refused with exit 5
    without the flag). It finishes with every sample of each epoch once and the loss of the
    uninterrupted plain run."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--nnodes", "2", "--node-rank", str(n),
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--interval", "4", "--max-restarts", "0",
         "--inject-crash", "10@0", "--job-dir", "job", SCRIPT, "ddp", "got.pt"],
        cwd=tmp_path, env=clean_env({"PYTHONPATH": str(SCRIPTS)}), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert all(p.returncode != 0 for p in nodes), [o[1][-2000:] for o in outs]
    job = tmp_path / "job"
    assert committed_steps(job / "checkpoints"), [o[1][-2000:] for o in outs]

    refused = _resume(job, tmp_path, "--nnodes", "1", "--nproc-per-node", "1")
    assert refused.returncode == 5, refused.stderr[-2000:]
    assert "--reshard" in refused.stderr and "2 ranks" in refused.stderr, refused.stderr
    one = _resume(job, tmp_path, "--reshard", "--nnodes", "1", "--nproc-per-node", "1")
    assert one.returncode == 0, one.stderr[-3000:]

    events = [json.loads(l) for l in (job / "events.jsonl").read_text().splitlines()]
    assert [(e["from_world_size"], e["to_world_size"]) for e in events
            if e["event"] == "resharded"] == [(2, 1)]
    _assert_every_sample_once(tmp_path, {2, 1})
    _assert_follows_plain([outs[0][0], outs[1][0], one.stdout], tmp_path, plain)
