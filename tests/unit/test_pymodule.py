"""``cfrun -m MODULE`` without processes (issue 34, item 3): the module's file found as
``python -m`` would find it, nothing of the package run; the module's name in the job's
identity and default job dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cfrun.contract.config import (
    Command,
    Identity,
    RunConfig,
    check_identity,
    default_job_dir,
    describe_changes,
)
from cfrun.contract.errors import BadInputError
from cfrun.contract.pymodule import find_module_file


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``pkg`` (an ``__init__`` that would leave a file if it ran), ``pkg.train``,
    ``pkg.sub`` with a ``__main__``, ``ns`` a namespace package, ``flat.py``."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("open('init-ran', 'w').close()\n")
    (pkg / "train.py").write_text("print('train')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "__main__.py").write_text("print('main')\n")
    (tmp_path / "ns").mkdir()
    (tmp_path / "ns" / "job.py").write_text("")
    (tmp_path / "flat.py").write_text("")
    return tmp_path


@pytest.mark.parametrize(("name", "file"), [
    ("pkg.train", "pkg/train.py"), ("pkg.sub", "pkg/sub/__main__.py"),
    ("ns.job", "ns/job.py"), ("flat", "flat.py")])
def test_finds_the_file_python_m_runs_without_running_the_package(tree: Path, name: str,
                                                                   file: str) -> None:
    assert find_module_file(name, tree) == (tree / file).resolve()
    assert not (tree / "init-ran").exists() and not Path("init-ran").exists()


@pytest.mark.parametrize(("name", "said"), [
    ("pkg.nope", "no module 'pkg.nope' found from package 'pkg'"),
    ("nope_at_all_zz", "no module 'nope_at_all_zz' found from"),
    ("pkg.train.x", "'pkg.train' is a module, not a package"),
    ("pkg", "a package without a __main__ module"),
    ("pkg/train.py", "not a module name (without .py: -m pkg.train)"),
    (".train", "not a module name"),
    ("sys", "not a Python source file"),
])
def test_refusals_name_the_value_and_the_fix(tree: Path, name: str, said: str) -> None:
    with pytest.raises(BadInputError) as e:
        find_module_file(name, tree)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tree / "init-ran").exists()


def _config(tree: Path, module: str | None) -> RunConfig:
    return RunConfig(script=str(tree / "pkg" / "train.py"), script_args=["--lr", "1"],
                     job_dir=str(tree / "j"), cwd=str(tree), module=module)


def test_the_module_name_is_part_of_the_command(tree: Path) -> None:
    """A script's fingerprint is what it always was; the same file run as a module is another
    command (its ``__package__`` differs), recorded in identity.json and read back."""
    as_script = Command.of(_config(tree, None))
    as_module = Command.of(_config(tree, "pkg.train"))
    assert as_script.module is None and as_module.module == "pkg.train"
    assert as_script.fingerprint != as_module.fingerprint
    legacy = json.dumps([as_script.script_sha256, ["--lr", "1"], 1])
    import hashlib

    assert as_script.fingerprint == hashlib.sha256(legacy.encode()).hexdigest()
    identity = Identity.new(as_module, "job")
    doc = identity.to_json()
    assert doc["module"] == "pkg.train" and "module" not in Identity.new(as_script,
                                                                        "job").to_json()
    assert Identity.from_json(doc, "x").command == as_module
    assert describe_changes(identity, as_script, None) == ["-m pkg.train -> script"]
    path = tree / "j" / "identity.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc))
    assert check_identity(path, as_module, job_name=None, accept_changed=False)[1] == []


def test_default_job_dir_names_the_module(tree: Path) -> None:
    a = default_job_dir(str(tree / "pkg" / "train.py"), tree, module="pkg.train")
    b = default_job_dir(str(tree / "pkg" / "train.py"), tree)
    assert a.name.startswith("pkg.train-") and b.name.startswith("train-") and a != b


def test_a_recorded_module_must_be_a_module_name(tree: Path) -> None:
    with pytest.raises(BadInputError, match="not a module name"):
        _config(tree, "../evil")
