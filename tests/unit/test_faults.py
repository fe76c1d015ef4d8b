"""Unit tests for cfrun.contract.faults: named points, a no-op when unarmed, typos refused; and
the storage throttle point read once per file written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfrun.contract import faults
from cfrun.contract.errors import EXIT_BAD_INPUT, BadInputError

ROOT = Path(__file__).resolve().parents[2]
PREFIXES = ("agent.", "rank.", "storage.", "peer.", "supervisor.")


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.reset()
    yield
    faults.reset()


def _arm_here(monkeypatch: pytest.MonkeyPatch, **points: object) -> None:
    monkeypatch.setenv(faults.ENV, faults.arm({}, **points)[faults.ENV])
    faults.reset()


def test_unarmed_points_are_none() -> None:
    assert all(faults.value(name) is None for name in faults.POINTS)


def test_armed_point_has_its_value_and_others_stay_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert faults.check() == {}
    faults.reset()
    _arm_here(monkeypatch, **{"agent.kill_at_step": 40})
    assert faults.check() == {"agent.kill_at_step": 40}
    assert faults.value("agent.kill_at_step") == 40
    assert faults.value("agent.commit_delay_s") is None


def test_undeclared_point_raises_armed_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError, match="agent.kill_at_stp"):
        faults.value("agent.kill_at_stp")
    _arm_here(monkeypatch, **{"agent.kill_at_step": 1})
    with pytest.raises(KeyError):
        faults.value("agent.kill_at_stp")


def test_arm_validates_names_and_leaves_env_alone() -> None:
    env = {"OTHER": "x"}
    with pytest.raises(KeyError, match="agent.typo"):
        faults.arm(env, **{"agent.typo": 1})
    armed = faults.arm(env, **{"agent.kill_at_step": 30})
    again = faults.arm(armed, agent__commit_delay_s=0.5)  # "__" stands for "."
    assert env == {"OTHER": "x"}
    assert json.loads(again[faults.ENV]) == {"agent.kill_at_step": 30,
                                             "agent.commit_delay_s": 0.5}
    assert again["OTHER"] == "x"


@pytest.mark.parametrize(("raw", "needle"), [
    ("{not json", "is not a JSON object"),
    ("[1]", "is not a JSON object"),
    ('{"agent.kill_at_stp": 3}', "undeclared fault points ['agent.kill_at_stp']"),
])
def test_bad_variable_is_one_line_bad_input(monkeypatch: pytest.MonkeyPatch, raw: str,
                                            needle: str) -> None:
    monkeypatch.setenv(faults.ENV, raw)
    with pytest.raises(BadInputError) as e:
        faults.value("agent.kill_at_step")
    assert needle in str(e.value) and "CFRUN_FAULTS" in str(e.value)
    assert "\n" not in str(e.value) and e.value.exit_code == EXIT_BAD_INPUT


def test_cli_stops_on_a_malformed_variable_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    from cfrun.cli.app import main

    monkeypatch.setenv(faults.ENV, '{"agent.kill_at_stp": 3}')
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path)])
    assert e.value.code == EXIT_BAD_INPUT
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("cfrun: error: CFRUN_FAULTS arms undeclared fault points")


def test_points_are_declared_with_a_process_prefix_and_a_meaning() -> None:
    for name, meaning in faults.POINTS.items():
        assert name.startswith(PREFIXES) and re.fullmatch(r"[a-z]+\.[a-z0-9_]+", name), name
        assert len(meaning) > 20, name


def test_product_code_asks_only_for_declared_points_and_reads_no_test_variables() -> None:
    used: set[str] = set()
    for p in ROOT.glob("cfrun/**/*.py"):
        text = p.read_text()
        used |= set(re.findall(r"faults\.value\(\"([^\"]+)\"\)", text))
        if p.name != "faults.py":  # points passed on by name (snapshot's one-shot faults)
            used |= set(re.findall(r"\"((?:agent|rank|storage|peer|supervisor)\.[a-z_]+)\"",
                                   text)) & set(faults.POINTS)
        assert "CFRUN_TEST_" not in text, p
    assert used <= set(faults.POINTS), used - set(faults.POINTS)
    # every declared point is read somewhere
    assert set(faults.POINTS) <= used


def test_point_travels_to_a_child_process() -> None:
    """The agent, the peer and the ranks are other processes: the environment carries points."""
    env = faults.arm({"PYTHONPATH": str(ROOT)}, **{"peer.flush_delay_s": 2.5})
    code = "from cfrun.contract import faults; print(faults.value('peer.flush_delay_s'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.stdout.strip() == "2.5", out.stderr


# ---------------------------------------------------------------- storage.throttle_bytes_per_s


@pytest.mark.parametrize("scheme", ["", "file://"])  # DirStorage, FsspecStorage
def test_throttle_limits_level2_writes_and_is_read_once_per_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scheme: str) -> None:
    from cfrun.storage import tiers

    parts = [b"x" * (256 << 10)] * 4  # 1 MiB in four chunks
    store = tiers.open_storage(f"{scheme}{tmp_path / 'l2'}")
    t0 = time.monotonic()
    store.begin("job", 1).write_file("rank-00000.bin", parts)
    unthrottled_s = time.monotonic() - t0

    _arm_here(monkeypatch, **{"storage.throttle_bytes_per_s": 4 << 20})  # 4 MiB/s
    reads: list[str] = []
    real_value = faults.value

    def counting(name: str) -> object:
        reads.append(name)
        return real_value(name)

    monkeypatch.setattr(faults, "value", counting)
    t0 = time.monotonic()
    n = store.begin("job", 2).write_file("rank-00000.bin", parts)
    throttled_s = time.monotonic() - t0
    assert n == 1 << 20
    assert throttled_s >= 0.2 > unthrottled_s, (throttled_s, unthrottled_s)  # ~0.25 s at 4 MiB/s
    assert reads == ["storage.throttle_bytes_per_s"]  # once for the file, not per chunk
