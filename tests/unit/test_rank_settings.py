"""The ranks' settings travel as one JSON value (CFRUN_RANK_SETTINGS): what the supervisor builds
(cfrun.supervisor.launcher.build_worker_env) is what each rank reads back, and anything else is
refused with a one-line reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cfrun.contract import settings as E
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import BadInputError
from cfrun.rank.settings import RankSettings
from cfrun.supervisor.launcher import build_worker_env


def _cfg(tmp_path: Path, **kw: object) -> RunConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    return RunConfig(script=str(script), script_args=["--lr", "1"], job_dir=str(tmp_path / "j"),
                     cwd=str(tmp_path), **kw)  # type: ignore[arg-type]


def test_what_the_supervisor_sets_is_what_the_rank_reads(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, interval=7, overhead=0.05, profile_only=True, inject_crash="35@0,70@1")
    env = build_worker_env(cfg, 3, {E.FF_EVAL: "run", "RANK": "1", "WORLD_SIZE": "2",
                                    "LOCAL_RANK": "1"}, mtbf_s=3600.0)
    # one structured value instead of a dozen variables
    assert not [k for k in env if k.startswith("CFRUN_RANK_") and k not in (
        E.RANK_SETTINGS, E.RANK_JOB_DIR, E.RANK_SUPERVISOR_PID)]
    s = RankSettings.from_env(env)
    assert s == RankSettings(
        job_dir=Path(cfg.job_dir), script=os.path.realpath(cfg.script), attempt=3, interval=7,
        overhead=0.05, mtbf_s=3600.0, profile_only=True, inject_crash=((35, 0), (70, 1)),
        ff_eval="run", supervisor_pid=os.getpid(), node_rank=0, rank=1, world_size=2,
        local_rank=1)
    assert RankSettings.from_json(s.to_json(), rank=1, world_size=2, local_rank=1) == s


def test_defaults_without_interval_or_mtbf(tmp_path: Path) -> None:
    env = build_worker_env(_cfg(tmp_path), 0, {})
    s = RankSettings.from_env(env)
    assert (s.interval, s.mtbf_s, s.inject_crash, s.ff_eval, s.rank, s.world_size) == (
        None, None, (), "one", 0, 1)


@pytest.mark.parametrize("change, message", [
    ({"keep": 2}, "unknown fields ['keep']"),
    ({"interval": "not-a-number"}, "interval 'not-a-number' has the wrong type"),
    ({"interval": 0}, "interval 0 must be at least 1"),
    ({"profile_only": 1}, "profile_only 1 has the wrong type"),
    ({"attempt": True}, "attempt True has the wrong type"),
    ({"overhead": 1.5}, "overhead 1.5 must lie in (0, 1)"),
    ({"ff_eval": "some"}, "ff_eval 'some' must be 'one' or 'run'"),
    ({"inject_crash": [[5]]}, "inject_crash [[5]] must be a list of [step, attempt] pairs"),
    ({"job_dir": None}, "job_dir and script must be strings"),
])
def test_bad_settings_are_refused_with_the_field_named(tmp_path: Path, change: dict[str, object],
                                                       message: str) -> None:
    doc = json.loads(build_worker_env(_cfg(tmp_path), 0, {})[E.RANK_SETTINGS])
    doc.update(change)
    with pytest.raises(BadInputError) as err:
        RankSettings.from_env({E.RANK_SETTINGS: json.dumps(doc)})
    assert message in str(err.value)


def test_missing_or_malformed_variable_is_refused() -> None:
    with pytest.raises(BadInputError, match="CFRUN_RANK_SETTINGS is not set"):
        RankSettings.from_env({})
    with pytest.raises(BadInputError, match="is not JSON"):
        RankSettings.from_env({E.RANK_SETTINGS: "{job_dir: x"})
    with pytest.raises(BadInputError, match="must be a JSON object"):
        RankSettings.from_env({E.RANK_SETTINGS: "[1, 2]"})
    with pytest.raises(BadInputError, match="lacks the fields"):
        RankSettings.from_env({E.RANK_SETTINGS: json.dumps({"job_dir": "/j"})})


def test_a_bad_ff_eval_fails_in_the_supervisor_not_in_the_ranks(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="CFRUN_FF_EVAL"):
        build_worker_env(_cfg(tmp_path), 0, {E.FF_EVAL: "all"})
