"""``--launcher python --nproc-per-node N``: cfrun's supervisor starts the ranks of one node
itself (cfrun.supervisor.local_ranks). Each local rank's environment is what ``torchrun
--standalone`` gives its worker (checked against torch's own source and the values torch 2.13
sets), one rank keeps no torchrun variable at all, several nodes are refused in one line, and
the attempt ends as torchrun's does: a failed rank gets the others SIGTERMed, then SIGKILLed
after the grace, and the attempt failed (status 1, the failed rank in ``rank_exits``).
Real processes for the teardown, no sleeps as waits."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.elastic.agent.server.local_elastic_agent as agent_module

from cfrun.contract.config import RunConfig
from cfrun.contract.errors import BadInputError
from cfrun.rank.settings import RankSettings
from cfrun.supervisor.launcher import TORCHRUN_VARIABLES, build_worker_env, local_rank_env
from cfrun.supervisor.local_ranks import LocalRanks

DIFFERENT = {"TORCHELASTIC_USE_AGENT_STORE": "False"}
"""Where cfrun's values differ from torchrun's on purpose (no agent: rank 0 hosts the store)."""


def _cfg(tmp_path: Path, **kw: object) -> RunConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    return RunConfig(script=str(script), script_args=[], job_dir=str(tmp_path / "j"),
                     cwd=str(tmp_path), launcher="python", **kw)  # type: ignore[arg-type]


def _torchrun_worker_keys() -> set[str]:
    """The keys of the ``worker_env`` dict torch's ``LocalElasticAgent._start_workers`` builds
    (read from the installed torch's source), plus ``LOCAL_RANK`` (set beside it)."""
    tree = ast.parse(Path(agent_module.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == "worker_env" for t in node.targets):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)} | {
                "LOCAL_RANK"}
    raise AssertionError("torch's worker_env dict not found")


def test_each_local_rank_gets_the_variables_torchrun_standalone_sets(tmp_path: Path) -> None:
    env = build_worker_env(_cfg(tmp_path, nproc_per_node=2), 3,
                           {"RANK": "7", "TORCHELASTIC_RUN_ID": "outer", "PATH": "/bin"})
    assert not [k for k in env if k in TORCHRUN_VARIABLES or k.startswith("TORCHELASTIC_")]
    assert env["OMP_NUM_THREADS"] == "1"  # torch.distributed.run's default for several ranks
    keys = _torchrun_worker_keys()
    for local_rank in (0, 1):
        got = local_rank_env(env, local_rank=local_rank, nproc_per_node=2, master_port=29411,
                             run_id="rid")
        assert keys <= set(got), sorted(keys - set(got))
        assert {k: got[k] for k in keys} == {
            "RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
            "ROLE_RANK": str(local_rank), "GROUP_RANK": "0", "ROLE_NAME": "default",
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29411",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "rid", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            **DIFFERENT}
        assert got["PATH"] == "/bin"
        s = RankSettings.from_env(got)
        assert (s.launcher, s.nproc_per_node, s.rank, s.local_rank, s.world_size) == (
            "python", 2, local_rank, local_rank, 2)


def test_one_rank_keeps_no_torchrun_variable_and_is_rank_0_of_1(tmp_path: Path) -> None:
    env = build_worker_env(_cfg(tmp_path), 0, {"RANK": "3", "WORLD_SIZE": "4",
                                               "TORCHELASTIC_RUN_ID": "x", "PATH": "/bin"})
    assert not [k for k in env if k in TORCHRUN_VARIABLES or k.startswith("TORCHELASTIC_")]
    assert "OMP_NUM_THREADS" not in env
    env["RANK"] = "5"  # a script that sets it for itself: still the one rank
    s = RankSettings.from_env(env)
    assert (s.rank, s.world_size, s.nproc_per_node) == (0, 1, 1)


def test_the_omp_threads_the_user_set_are_kept(tmp_path: Path) -> None:
    env = build_worker_env(_cfg(tmp_path, nproc_per_node=2), 0, {"OMP_NUM_THREADS": "4"})
    assert env["OMP_NUM_THREADS"] == "4"


def test_python_launcher_on_several_nodes_is_one_line_naming_the_value_and_the_fix(
        tmp_path: Path) -> None:
    with pytest.raises(BadInputError) as e:
        _cfg(tmp_path, nproc_per_node=2, nnodes=2, rdzv_endpoint="h:29400")
    msg = str(e.value)
    assert "\n" not in msg
    assert "--nnodes 2" in msg and "drop --launcher python" in msg, msg
    assert _cfg(tmp_path, nproc_per_node=4).nproc_per_node == 4


def test_rank_settings_refuse_a_world_other_than_the_nodes_ranks(tmp_path: Path) -> None:
    env = local_rank_env(build_worker_env(_cfg(tmp_path, nproc_per_node=2), 0, {}),
                         local_rank=0, nproc_per_node=2, master_port=1, run_id="r")
    env["WORLD_SIZE"] = "3"
    with pytest.raises(BadInputError, match="launcher 'python' runs the 2 rank"):
        RankSettings.from_env(env)


# ---------------------------------------------------------------- the attempt's end


def _proc(code: str) -> subprocess.Popen[str]:
    """``python -c code``, its stdout a pipe: it prints ``up`` once its handlers are set."""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "up\n"
    return p


WAITS = "import signal, sys; {handler}print('up', flush=True); signal.pause()"


def test_all_ranks_exit_0_is_success() -> None:
    ranks = LocalRanks([subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(3)])
    assert ranks.wait(timeout=300) == 0
    assert ranks.rank_exits == ()


def test_a_failed_rank_gets_the_others_sigtermed_and_the_attempt_fails() -> None:
    sleeper = _proc(WAITS.format(handler=""))
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    ranks = LocalRanks([sleeper, failing])  # type: ignore[list-item]
    assert ranks.wait(timeout=300) == 1
    assert ranks.rank_exits == ((1, 3),)
    assert sleeper.returncode == -signal.SIGTERM


def test_a_rank_ignoring_sigterm_is_sigkilled_after_the_grace() -> None:
    stubborn = _proc(WAITS.format(handler="signal.signal(signal.SIGTERM, signal.SIG_IGN); "))
    victim = _proc(WAITS.format(handler=""))
    ranks = LocalRanks([stubborn, victim], grace_s=0.5)  # type: ignore[list-item]
    with pytest.raises(subprocess.TimeoutExpired):
        ranks.wait(timeout=0.05)  # both still run
    victim.kill()
    assert ranks.wait(timeout=300) == 1
    assert ranks.rank_exits == ((1, -signal.SIGKILL),)
    assert stubborn.returncode == -signal.SIGKILL
