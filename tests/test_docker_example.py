"""The container image's install steps (examples/docker/Dockerfile) work in a fresh environment.

No Docker here: the test plays the Dockerfile itself. Its COPY steps copy the same paths from
this checkout into a fresh directory (the image's WORKDIR), its RUN steps run with ``sh -c`` in
a fresh virtual environment (``TORCH_INDEX_URL=`` as a build would pass it where torch comes from
elsewhere; that environment sees this one's packages through a ``.pth`` file, so pip finds torch
installed instead of downloading it), then the installed ``cfrun`` resolves the example job."""

from __future__ import annotations

import json
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DOCKERFILE = ROOT / "examples" / "docker" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    lines, out = DOCKERFILE.read_text().splitlines(), []
    for line in lines:
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_dockerfile_installs_cfrun_and_runs_the_example(tmp_path: Path) -> None:
    steps = _instructions()
    assert steps[0][0] == "FROM" and steps[-1] == ("ENTRYPOINT", '["cfrun"]')
    workdir = tmp_path / "image" / "opt" / "cfrun"
    workdir.mkdir(parents=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv),
                                                        "platbase": str(venv)}))
    # this environment's packages (torch) visible to the fresh one
    (purelib / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "TORCH_INDEX_URL": "",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": str(tmp_path)}
    ran = 0
    for word, rest in steps:
        if word == "COPY":
            *sources, dest = rest.split()
            for src in sources:
                target = workdir / dest if dest != "./" else workdir
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns(
                        "__pycache__", "cfrun-jobs"))
                else:
                    shutil.copy(ROOT / src, workdir / Path(src).name)
        elif word == "RUN":
            run = subprocess.run(["sh", "-c", rest], cwd=workdir, env=env, text=True,
                                 capture_output=True, timeout=500)
            assert run.returncode == 0, (rest, run.stdout[-2000:], run.stderr[-2000:])
            ran += 1
    assert ran == 2
    assert re.search(r"^cfrun \S+$", run.stdout.strip().splitlines()[-1])
    dry = subprocess.run([str(venv / "bin" / "cfrun"), "--dry-run", "--interval", "20",
                          "examples/digits_train.py", "--epochs", "2"], cwd=workdir, env=env,
                         text=True, capture_output=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert json.loads(dry.stdout)["config"]["script"] == str(workdir / "examples" /
                                                             "digits_train.py")
    hooks = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import cfrun.supervisor.launcher as l; print(l.hooks_dir())"],
                           cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert hooks.returncode == 0, hooks.stderr
    assert (Path(hooks.stdout.strip()) / "sitecustomize.py").is_file()
