"""Unit tests for cfrun.contract.settings: every CFRUN_* name is declared there, once, and read
through typed accessors that name the variable and the fix when its value is bad."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import manual_text

from cfrun.contract import settings
from cfrun.contract.errors import EXIT_BAD_INPUT, BadInputError

ROOT = Path(__file__).resolve().parents[2]
NAME_RE = re.compile(r"CFRUN_[A-Z0-9_]+")
SETTINGS_PY = "cfrun/contract/settings.py"

# String literals that name a variable outside settings.py, each with its reason.
LITERAL_ALLOWED: dict[str, set[str]] = {
    # the hook runs in every process on the ranks' PYTHONPATH: it imports nothing from cfrun
    # before it knows it is a rank
    "hooks/sitecustomize.py": {"CFRUN_RANK_SETTINGS", "CFRUN_HOOK_OWNER_PID",
                               "CFRUN_VERIFY_OBSERVE"},
}


def _sources() -> list[Path]:
    return sorted([*ROOT.glob("cfrun/**/*.py"), *ROOT.glob("hooks/*.py"),
                   *ROOT.glob("bench/*.py")])


def _is_declared(token: str) -> bool:
    if token.endswith("_"):  # a prefix, e.g. "CFRUN_RANK_"
        return any(name.startswith(token) for name in settings.SETTINGS)
    return token in settings.SETTINGS


# ---------------------------------------------------------------- one place for every name


def test_every_cfrun_name_in_the_source_is_declared() -> None:
    undeclared = {f"{p.relative_to(ROOT)}: {tok}" for p in _sources()
                  for tok in NAME_RE.findall(p.read_text()) if not _is_declared(tok)}
    assert not undeclared, sorted(undeclared)


def test_no_module_but_settings_spells_a_variable_name() -> None:
    """A ``"CFRUN_..."`` string literal (not prose in a docstring) outside settings.py is a second
    definition of the name: code must use the constant of cfrun.contract.settings."""
    found: set[str] = set()
    for p in _sources():
        rel = str(p.relative_to(ROOT))
        if rel == SETTINGS_PY or rel.startswith("bench/"):  # scripts apart from the package
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and NAME_RE.fullmatch(node.value) and not node.value.endswith("_") \
                    and node.value not in LITERAL_ALLOWED.get(rel, set()):
                found.add(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, sorted(found)


def test_declarations_are_complete() -> None:
    assert len(settings.SETTINGS) >= 35
    for name, s in settings.SETTINGS.items():
        assert s.name == name and NAME_RE.fullmatch(name)
        assert s.type in settings.TYPES and s.set_by in settings.SET_BY, name
        assert len(s.meaning) > 10, name
        assert (s.type == "choice") == bool(s.choices), name
        if s.choices and s.default is not None:
            assert s.default in s.choices, name
        # the module constant named after the variable is the name itself
        assert getattr(settings, name.removeprefix("CFRUN_")) == name
    with pytest.raises(ValueError):
        settings._declare("CFRUN_JOB_DIR", "path", None, "declared twice")
    with pytest.raises(ValueError):
        settings._declare("CFRUN_NEW", "no-such-type", None, "unknown type")


def test_declared_defaults_parse() -> None:
    """Every default goes through its accessor like a set value."""
    for name, s in settings.SETTINGS.items():
        reader = {"int": settings.get_int, "float": settings.get_float,
                  "flag": settings.get_flag, "json": settings.get_json}.get(s.type,
                                                                           settings.get_str)
        value = reader(name, {})
        if s.default is None and s.type != "flag":
            assert value is None, name


def test_manual_table_matches_the_declarations() -> None:
    """The manual (README.md and docs/; the table: docs/command-line.md) names only declared
    variables, and its options table gives each one's declared default."""
    manual = manual_text()
    assert SETTINGS_PY in manual  # where the rest are listed
    undeclared = {tok for tok in NAME_RE.findall(manual) if not _is_declared(tok)}
    assert not undeclared, sorted(undeclared)
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| `(CFRUN_[A-Z_]+)` \| ([^|]+) \|", manual,
                      flags=re.MULTILINE)
    assert len(rows) >= 19
    for flag, name, default in rows:
        s = settings.SETTINGS[name]
        want = s.default if s.default is not None else s.unset
        assert default.strip().strip("`") == want, (flag, name, default, want)


def test_cli_options_use_declared_variables_and_defaults() -> None:
    """Each option of ``cfrun run``/``profile``/``peer`` with an environment variable has the
    default that settings.py declares for it (typer reads the variable, settings documents it)."""
    import typer

    from cfrun.cli.app import app

    group = typer.main.get_command(app)
    checked = 0
    for command in group.commands.values():  # type: ignore[attr-defined]
        for param in command.params:
            if not getattr(param, "envvar", None):
                continue
            s = settings.SETTINGS[param.envvar]
            assert s.set_by == "user", param.envvar
            assert (param.default or None) == s.default, (command.name, param.name)
            checked += 1
    assert checked >= 24


# ---------------------------------------------------------------- typed accessors


def test_get_int_parses_defaults_and_validates() -> None:
    assert settings.get_int(settings.KEEP, {}) == 2  # the declared default
    assert settings.get_int(settings.KEEP, {settings.KEEP: " 7 "}) == 7
    assert settings.get_int(settings.KEEP, {settings.KEEP: ""}) == 2  # empty = unset
    assert settings.get_int(settings.INTERVAL, {}) is None  # no default
    with pytest.raises(BadInputError) as e:
        settings.get_int(settings.NODE_RANK, {settings.NODE_RANK: "two"})
    msg = str(e.value)
    assert msg.startswith("CFRUN_NODE_RANK='two' is not a whole number;") and "\n" not in msg
    assert "unset it for the default, 0" in msg
    assert e.value.exit_code == EXIT_BAD_INPUT
    with pytest.raises(BadInputError, match=r"CFRUN_NODE_RANK='-1' is not a whole number >= 0"):
        settings.get_int(settings.NODE_RANK, {settings.NODE_RANK: "-1"}, minimum=0)


@pytest.mark.parametrize("text", ["abc", "nan", "inf", "-1"])
def test_get_float_refuses_non_finite_and_below_minimum(text: str) -> None:
    with pytest.raises(BadInputError, match=rf"^CFRUN_PROGRESS_S='{text}' is not a number >= 0;"):
        settings.get_float(settings.PROGRESS_S, {settings.PROGRESS_S: text}, minimum=0)


def test_get_float_default_and_value() -> None:
    assert settings.get_float(settings.PROGRESS_S, {}) == 30.0
    assert settings.get_float(settings.PROGRESS_S, {settings.PROGRESS_S: "0.5"}) == 0.5


@pytest.mark.parametrize(("text", "expected"), [
    ("1", True), ("true", True), ("YES", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_get_flag(text: str, expected: bool) -> None:
    assert settings.get_flag(settings.DEBUG, {settings.DEBUG: text}) is expected


def test_get_flag_refuses_other_words() -> None:
    with pytest.raises(BadInputError, match=r"^CFRUN_DEBUG='maybe' is not 1 or 0;"):
        settings.get_flag(settings.DEBUG, {settings.DEBUG: "maybe"})


def test_get_str_checks_choices() -> None:
    assert settings.get_str(settings.SHARD, {}) == "1"
    assert settings.get_str(settings.SHARD, {settings.SHARD: "rank0"}) == "rank0"
    assert settings.get_str(settings.PEER_JOB, {}) is None
    with pytest.raises(BadInputError, match=r"^CFRUN_FF_EVAL='all' is not one of one, run;"):
        settings.get_str(settings.FF_EVAL, {settings.FF_EVAL: "all"})


def test_get_json_wants_an_object() -> None:
    assert settings.get_json(settings.RANK_SETTINGS, {}) is None
    value = settings.get_json(settings.RANK_SETTINGS, {settings.RANK_SETTINGS: '{"keep": 3}'})
    assert value == {"keep": 3}
    for text in ("[1, 2]", "{not json", "3"):
        with pytest.raises(BadInputError, match="is not a JSON object"):
            settings.get_json(settings.RANK_SETTINGS, {settings.RANK_SETTINGS: text})


def test_accessors_refuse_undeclared_names_and_wrong_types() -> None:
    with pytest.raises(KeyError, match="CFRUN_NO_SUCH"):
        settings.get_str("CFRUN_NO_SUCH", {})
    with pytest.raises(TypeError, match="CFRUN_KEEP is declared as int"):
        settings.get_float(settings.KEEP, {})


def test_accessors_read_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.NODE_RANK, "3")
    assert settings.node_rank() == 3 and settings.node_suffix() == "-node3"
    monkeypatch.setenv(settings.NODE_RANK, "0")
    assert settings.node_suffix() == ""
    monkeypatch.delenv(settings.NODE_RANK)
    assert settings.node_rank() == 0
    monkeypatch.setenv(settings.NODE_RANK, "x")
    with pytest.raises(BadInputError, match="CFRUN_NODE_RANK='x'"):
        settings.node_suffix()


def test_cli_reports_a_bad_setting_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """``cfrun`` with a bad CFRUN_DEBUG: exit code 2 and one line naming the variable, before
    anything is read or written."""
    from cfrun.cli.app import main

    monkeypatch.setenv(settings.DEBUG, "maybe")
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path / "none")])
    assert e.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cfrun: error: CFRUN_DEBUG='maybe' is not 1 or 0")
    assert list(tmp_path.iterdir()) == []
