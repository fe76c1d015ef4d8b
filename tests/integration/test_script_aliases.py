"""Script variables that alias the live model and optimizer keep being aliases after a resume
(issue 34, item 1): ``sd = model.state_dict()``, views of the parameters, an optimizer's
``state_dict()`` come back as views of the restored objects, copies the script made
(``.clone()``, ``copy.deepcopy``) as values. Real processes, a real SIGKILL."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, plain_run, run_cfrun

pytestmark = pytest.mark.timeout(600)


def test_state_dict_and_views_held_by_the_script_stay_aliases(tmp_path: Path) -> None:
    script = str(SCRIPTS / "train_alias.py")
    plain_run([script, "plain.pt"], tmp_path)
    run = run_cfrun(["--interval", "10", "--job-dir", "job", "--inject-crash", "35", script,
                     "cf.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.events("resumed"), run.stderr[-3000:]
    ref = torch.load(tmp_path / "plain.pt", weights_only=True)
    got = torch.load(tmp_path / "cf.pt", weights_only=True)
    assert got["shares"] == ref["shares"], got["shares"]  # aliases share the live storage
    for key in ("sd", "views", "row", "moments", "clone", "deep", "snap"):
        assert_bit_identical(got[key], ref[key], key)
    assert "cannot tell" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_verify_is_exact_for_a_checkpoint_dict_kept_in_a_variable() -> None:
    """nanoGPT keeps ``checkpoint = {'model': raw_model.state_dict(), 'optimizer':
    optimizer.state_dict(), ...}`` in a variable; a copy restored from step 5 differed at
    the stop step from the uninterrupted run's live values."""
    tmp = Path(tempfile.mkdtemp(prefix="cfa", dir="/tmp"))  # short TMPDIR (test_verify.py)
    try:
        run = run_cfrun(["verify", "--json", "--launcher", "python", "--steps", "20",
                         "--interval", "5", "--kills", "1",
                         str(SCRIPTS / "verify_nanogpt_checkpoint.py")], cwd=tmp,
                        env={"TMPDIR": str(tmp)}, timeout=540)
        assert run.stdout.lstrip().startswith("{"), run.stdout[-2000:] + run.stderr[-3000:]
        rep = json.loads(run.stdout)
        assert run.returncode == 0, json.dumps(rep, indent=1) + run.stderr[-3000:]
        assert rep["verdict"] == "exact" and rep["kills"][0]["landed"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
