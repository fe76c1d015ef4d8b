"""Unit tests for cfrun.contract.config: value parsers and RunConfig."""

from __future__ import annotations

import json

import pytest

from cfrun.contract.config import (
    RunConfig,
    parse_inject_crash,
    parse_interval,
    parse_overhead,
)
from cfrun.contract.errors import EXIT_BAD_INPUT, BadInputError

# ---------------------------------------------------------------- parse_overhead


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3.5%", 0.035),
        ("3.5", 0.035),
        ("1", 0.01),
        ("0.5", 0.005),
        ("0.1", 0.001),
        ("1%", 0.01),
        ("0.5%", 0.005),
        (" 10 % ", 0.10),
        ("99.9%", 0.999),
    ],
)
def test_parse_overhead_valid(text: str, expected: float) -> None:
    assert parse_overhead(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", ["-1", "0", "0%", "200%", "100", "100%", "fast", "", "3.5%%",
                                  "0.035", "0.05%"])
def test_parse_overhead_invalid_names_value(text: str) -> None:
    with pytest.raises(BadInputError) as info:
        parse_overhead(text)
    # The message quotes the bad value (repr, so "" shows up as '').
    assert repr(text) in str(info.value)
    assert info.value.exit_code == EXIT_BAD_INPUT


# ---------------------------------------------------------------- parse_interval


@pytest.mark.parametrize(("text", "expected"), [("5", 5), ("1", 1), (" 50 ", 50)])
def test_parse_interval_valid(text: str, expected: int) -> None:
    value = parse_interval(text)
    assert value == expected
    assert type(value) is int


@pytest.mark.parametrize("text", ["0", "-3", "abc", "1.5", ""])
def test_parse_interval_invalid_names_value(text: str) -> None:
    with pytest.raises(BadInputError) as info:
        parse_interval(text)
    assert repr(text) in str(info.value)


# ---------------------------------------------------------------- parse_inject_crash


def test_parse_inject_crash_single_step_defaults_to_attempt_0() -> None:
    assert parse_inject_crash("150") == [(150, 0)]


def test_parse_inject_crash_several() -> None:
    assert parse_inject_crash("150@1,300@2") == [(150, 1), (300, 2)]


def test_parse_inject_crash_empty_is_no_crash() -> None:
    assert parse_inject_crash("") == []


@pytest.mark.parametrize("text", ["x", "150@x", "1,y@2"])
def test_parse_inject_crash_malformed(text: str) -> None:
    with pytest.raises(BadInputError) as info:
        parse_inject_crash(text)
    assert repr(text) in str(info.value)


# ---------------------------------------------------------------- RunConfig


def _cfg(**kw: object) -> RunConfig:
    base: dict[str, object] = dict(
        script="/abs/train.py", script_args=["--lr", "0.1"], job_dir="/abs/job", cwd="/abs"
    )
    base.update(kw)
    return RunConfig(**base)  # type: ignore[arg-type]


def test_runconfig_defaults_are_valid() -> None:
    cfg = _cfg()
    assert cfg.nproc_per_node == 1
    assert cfg.keep == 2
    assert cfg.interval is None and cfg.overhead == 0.035  # the policy chooses


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"nproc_per_node": 0}, "nproc-per-node"),
        ({"max_restarts": -1}, "max-restarts"),
        ({"keep": 0}, "keep"),
        ({"interval": 0}, "interval"),
        ({"overhead": 0.0}, "overhead"),
        ({"overhead": 1.0}, "overhead"),
    ],
)
def test_runconfig_rejects_invalid(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(BadInputError) as info:
        _cfg(**kw)
    assert needle in str(info.value)


def test_runconfig_boundary_values_accepted() -> None:
    cfg = _cfg(max_restarts=0, keep=1, nproc_per_node=1, interval=1)
    assert (cfg.max_restarts, cfg.keep, cfg.interval) == (0, 1, 1)


def test_runconfig_json_round_trip() -> None:
    cfg = _cfg(interval=25, overhead=0.02, nproc_per_node=4, max_restarts=3, keep=5,
               grace_s=10.0, inject_crash="150@1", env={"CFRUN_X": "1", "OMP_NUM_THREADS": "2"})
    data = cfg.to_json()
    # It must really be JSON-able, and survive a trip through text.
    again = RunConfig.from_json(json.loads(json.dumps(data)))
    assert again == cfg
    assert again.script_args == ["--lr", "0.1"]
    assert again.env == {"CFRUN_X": "1", "OMP_NUM_THREADS": "2"}


def test_runconfig_from_json_ignores_unknown_keys() -> None:
    cfg = _cfg(keep=3)
    data = {**cfg.to_json(), "cfrun_version": "9.9.9", "format_version": 1, "future_flag": True}
    assert RunConfig.from_json(data) == cfg


def test_runconfig_from_json_validates() -> None:
    data = {**_cfg().to_json(), "keep": 0}
    with pytest.raises(BadInputError):
        RunConfig.from_json(data)


def test_a_fraction_given_as_overhead_is_refused_with_the_percentage_it_meant() -> None:
    """One rule (a number is percent): 0.035 is not silently 0.035% nor 3.5%; the error says."""
    with pytest.raises(BadInputError, match=r"means 0.035%.*for 3.5% write 3.5%"):
        parse_overhead("0.035")
