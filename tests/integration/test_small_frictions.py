"""The smaller frictions of a torchrun user's first hour (issue 37, item 7), each with real
cfrun processes and real job dirs: ``--overhead -1``, a final checkpoint in ``cfrun ls``, a
resume whose total is not known in ``cfrun status``, ``--plot`` saying where it wrote, a
one-rank job's own connection error, the changed-arguments line naming the option, the
group-writable warning once per job dir. (The argparse typo's hint:
``test_job_list.py::test_runs_that_trained_nothing_leave_no_job_dir``.)"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ARGPARSE_SCRIPT, SCRIPTS, cfrun_in_process, run_cfrun

pytestmark = pytest.mark.timeout(300)



@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A working directory with job dir ``j``: ``train_tiny.py --epochs 1`` run to its end
    (23 steps; no checkpoint due before its end, so none is in flight at the end of a run on a
    loaded machine: the final one at 23 is taken); tests copy it."""
    cwd = tmp_path_factory.mktemp("finished")
    run = run_cfrun(["--interval", "100", "--job-dir", "j", str(SCRIPTS / "train_tiny.py"),
                     "--epochs", "1", "--out", "o.pt"], cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return cwd


def test_a_negative_overhead_is_out_of_range_not_not_a_number(tmp_path):
    (tmp_path / "train.py").write_text("pass\n")
    run = cfrun_in_process(["--overhead", "-1", "train.py"], cwd=tmp_path)
    assert run.returncode == 2
    assert "is out of range" in run.stderr and "not a number" not in run.stderr, run.stderr
    assert not (tmp_path / "cfrun-jobs").exists()


def test_ls_shows_a_final_checkpoint_without_none(finished):
    assert any(r["final"] for r in json.loads(cfrun_in_process(["ls", "j", "--json"],
                                                               cwd=finished).stdout))
    run = cfrun_in_process(["ls", "j"], cwd=finished, env={"COLUMNS": "200"})
    assert run.returncode == 0, run.stderr
    final = next(ln for ln in run.stdout.splitlines() if "(final)" in ln)
    assert "None" not in run.stdout and "-" in final, run.stdout


def test_status_of_a_resume_without_its_total_says_why(finished, tmp_path):
    """A resume whose attempt before it left no end (its cfrun was SIGKILLed): the ``last
    resume`` row names the parts it has and why the total is missing, not ``: ?``."""
    jd = tmp_path / "j"
    shutil.copytree(finished / "j", jd)
    events = [json.loads(x) for x in (jd / "events.jsonl").read_text().splitlines()]
    t = events[-1]["t_unix_s"]
    events = [e for e in events if e["event"] != "attempt_end"]  # the end was never written
    events += [{"t_unix_s": t + 1, "event": "attempt_start", "attempt": 1, "argv": []},
               {"t_unix_s": t + 3, "event": "resumed", "attempt": 1, "rank": 0, "step": 20,
                "read_s": 0.25, "restore_s": 0.01}]
    (jd / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    run = cfrun_in_process(["status", "j"], cwd=tmp_path, env={"COLUMNS": "400"})
    assert run.returncode == 0, run.stderr
    row = next(ln for ln in run.stdout.splitlines() if "last resume" in ln)
    assert "attempt 1 at step 20" in row and "?" not in row, row
    assert "read 0.25 s" in row and "total not known" in row, row


def test_plot_says_where_it_wrote(finished, tmp_path):
    pytest.importorskip("matplotlib")
    run = cfrun_in_process(["status", str(finished / "j"), "--plot", "p.png"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "p.png").is_file()
    assert f"to {tmp_path / 'p.png'}" in run.stderr, run.stderr


def test_a_one_rank_jobs_own_connection_error_is_not_another_ranks(tmp_path):
    """A one-rank script whose own connection was reset (a download, a logging server): its
    traceback, not "a consequence of another rank's failure" (there is none)."""
    (tmp_path / "net.py").write_text(
        "import torch\n"
        "m = torch.nn.Linear(2, 2)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "m(torch.randn(3, 2)).sum().backward()\n"
        "opt.step()\n"
        "raise ConnectionResetError(104, 'Connection reset by peer')\n")
    run = run_cfrun(["--max-restarts", "0", "--job-dir", "j", "net.py"], cwd=tmp_path)
    assert run.returncode == 4, run.stderr[-3000:]
    assert "another rank" not in run.stderr, run.stderr[-3000:]
    assert "Traceback" in run.stderr and "ConnectionResetError" in run.stderr


@pytest.mark.slow
def test_the_changed_arguments_line_names_the_option_whose_value_changed(tmp_path):
    """``--epochs 2`` then ``--epochs 3 --lr 0.2`` on a job with a checkpoint: the refusal
    names ``--epochs`` on both sides (it said ``2 -> 3 --lr 0.2``)."""
    (tmp_path / "train.py").write_text(ARGPARSE_SCRIPT)
    first = run_cfrun(["--job-dir", "j", "--interval", "5", "--inject-crash", "12",
                       "--max-restarts", "0", "train.py", "--epochs", "2"], cwd=tmp_path)
    assert first.returncode == 4, first.stderr[-3000:]
    dry = cfrun_in_process(["--job-dir", "j", "--dry-run", "train.py", "--epochs", "3",
                            "--lr", "0.2"], cwd=tmp_path)
    outcome = json.loads(dry.stdout)["job_dir"]
    assert outcome.startswith("refused (exit 2)"), outcome
    assert "arguments --epochs 2 -> --epochs 3 --lr 0.2" in outcome, outcome


@pytest.mark.slow
def test_a_group_writable_checkout_is_warned_about_once_per_job_dir(tmp_path):
    """A checkout of mode 775 (``git archive``, a shared project dir): the warning comes when
    the default job dir is made, not on every later run of the job."""
    shared = tmp_path / "checkout"
    shared.mkdir()
    shared.chmod(0o775)
    (shared / "train.py").write_text(ARGPARSE_SCRIPT)
    runs = [run_cfrun(["train.py"], cwd=shared) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-3000:]
    assert "writable by its group" in runs[0].stderr
    assert "writable by its group" not in runs[1].stderr, runs[1].stderr


SCALER_WARNS = """\
import torch
model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda", enabled=True)  # warns on a machine without CUDA
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 2)).sum().backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_warning_of_a_wrapped_constructor_names_the_scripts_line(tmp_path):
    """GradScaler's own warning (``stacklevel=2``) named ``cfrun/rank/install.py``, the line of
    cfrun's wrapper of ``GradScaler.__init__``, where plain python names the script's line
    (nanoGPT's GradScaler warning; issue 37, item 7). The same line now, and ``-W error``
    still raises it from the constructor."""
    import subprocess
    import sys

    from conftest import clean_env

    (tmp_path / "scaler.py").write_text(SCALER_WARNS)
    plain = subprocess.run([sys.executable, "scaler.py"], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=300)
    said = [ln for ln in plain.stderr.splitlines() if "Warning:" in ln]
    assert said and said[0].startswith(f"{tmp_path / 'scaler.py'}:4: UserWarning"), plain.stderr
    run = run_cfrun(["--launcher", "python", "--job-dir", "j", "scaler.py"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [ln for ln in run.stderr.splitlines() if "Warning:" in ln] == said, run.stderr
    strict = run_cfrun(["--launcher", "python", "--job-dir", "k", "scaler.py"], cwd=tmp_path,
                       env={"PYTHONWARNINGS": "error:torch.cuda.amp.GradScaler:UserWarning"})
    assert strict.returncode != 0 and "UserWarning: torch.cuda.amp.GradScaler" in strict.stderr
