"""The command line as a new user meets it (issue 15, items 1, 3 and 4): the help text, torchrun's
spellings, the overhead rule, status without "None" and with the fatal error, export errors, and
the command of a finished job run again."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import typer
from conftest import SCRIPTS, cfrun_in_process, run_cfrun

from cfrun.cli.app import app

pytestmark = pytest.mark.timeout(300)


def _run_options() -> list[str]:
    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    return [opt for p in run.params for opt in getattr(p, "opts", []) if opt.startswith("--")]


@pytest.mark.parametrize("flag", ["--help", "-h", None])
def test_root_help_documents_the_script_form_every_run_option_and_the_commands(tmp_path, flag):
    run = cfrun_in_process([flag] if flag else [], cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert text.startswith("Usage: cfrun [OPTIONS] SCRIPT [ARGS]...\n")
    assert "cfrun COMMAND [ARGS]..." in text
    missing = [o for o in _run_options() if o not in text]
    assert not missing, missing
    for needle in ("--overhead PERCENT", "--interval INTEGER", "--grace DURATION",
                   "--version", "-h, --help", "--nproc-per-node, --nproc_per_node INTEGER"):
        assert needle in text, needle
    for command in ("resume", "profile", "status", "ls", "export", "peer"):
        assert re.search(rf"^  {command} ", text, re.MULTILINE), command
    assert "<str>" not in text and "{" not in text and "``" not in text and "`" not in text
    # `cfrun SCRIPT` is the spelling; `cfrun run` (in the README) is listed as the same
    # (issue 27, item 8)
    assert re.search(r"^  run +cfrun run SCRIPT \[ARGS\]\.\.\. is cfrun SCRIPT", text, re.MULTILINE)


@pytest.mark.parametrize("command", ["status", "ls", "export", "resume", "peer", "profile",
                                     "run"])
def test_each_command_help_has_types_and_no_markup(tmp_path, command):
    run = cfrun_in_process([command, "-h"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"Usage: cfrun {command} [OPTIONS]")
    assert "<str>" not in run.stdout and "{" not in run.stdout and "``" not in run.stdout


@pytest.mark.parametrize(("alias", "value", "canonical"), [
    ("--nproc_per_node", "0", "--nproc-per-node"),
    ("--max_restarts", "-1", "--max-restarts"),
    ("--node_rank", "x", "--node-rank"),
])
def test_torchrun_underscore_spellings_are_accepted(tmp_path, alias, value, canonical):
    """The alias reaches cfrun's own parser: its one-line error names the value."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    run = cfrun_in_process([alias, value, str(script)], cwd=tmp_path)
    assert run.returncode == 2
    assert f"{canonical} '{value}'" in run.stderr and "No such option" not in run.stderr
    assert len(run.stderr.strip().splitlines()) <= 2  # the error and, at most, a hint


def test_a_fraction_for_overhead_is_refused_with_the_rule(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    run = cfrun_in_process(["--overhead", "0.035", str(script)], cwd=tmp_path)
    assert run.returncode == 2
    assert "--overhead '0.035' means 0.035%" in run.stderr and "write 3.5%" in run.stderr
    assert not (tmp_path / "cfrun-jobs").exists()


def test_usage_errors_are_one_line_naming_the_command(tmp_path):
    run = cfrun_in_process(["export"], cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == "cfrun: error: Missing argument 'JOB_DIR'; see cfrun export --help"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_finished_job_says_so_and_runs_nothing_unless_rerun(tmp_path):
    args = ["--interval", "10", "--job-dir", "j", str(SCRIPTS / "train_tiny.py"), "--epochs", "1",
            "--out", "final.pt"]
    first = run_cfrun(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    out = tmp_path / "final.pt"
    before = (_digest(out), out.stat().st_mtime_ns)
    events_before = len(first.events())

    again = run_cfrun(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert re.search(r"finished at step 23 on \d{4}-\d\d-\d\d \d\d:\d\d UTC; nothing to do",
                     again.stderr), again.stderr
    assert (_digest(out), out.stat().st_mtime_ns) == before  # the script did not run
    assert len(again.events()) == events_before
    resumed = run_cfrun(["resume", "j"], cwd=tmp_path)
    assert resumed.returncode == 0 and "finished at step 23" in resumed.stderr
    assert len(first.events()) == events_before  # the same job dir: nothing ran

    rerun = run_cfrun(["--rerun", *args], cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert len(rerun.events("attempt_start")) == 2
    assert out.stat().st_mtime_ns != before[1]  # the tail ran again and saved again


def test_status_of_a_crash_loop_shows_the_error_and_never_none(tmp_path):
    run = run_cfrun(["--interval", "2", "--crash-loop", "2", "--job-dir", "j",
                     str(SCRIPTS / "fail_at_step.py"), "5"], cwd=tmp_path)
    assert run.returncode == 5, run.stderr[-2000:]
    st = json.loads(cfrun_in_process(["status", "j", "--json"], cwd=tmp_path).stdout)
    assert st["state"] == "fatal"
    assert "crash loop" in st["error"] and "ValueError: bad batch at step 5" in st["error"]
    table = cfrun_in_process(["status", "j"], cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "None" not in table.stdout
    assert "bad batch at step 5" in table.stdout.replace("\n", " ").replace("│", " ") \
        or "bad batch" in table.stdout
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text(json.dumps({"script": "x.py", "overhead": 0.035}))
    (fresh / "events.jsonl").write_text("")
    empty = cfrun_in_process(["status", str(fresh)], cwd=tmp_path)
    assert empty.returncode == 0, empty.stderr
    assert "None" not in empty.stdout and "no step seen yet" in empty.stdout


def test_export_to_a_missing_directory_is_one_line_and_writes_nothing(tmp_path):
    run = run_cfrun(["--interval", "5", "--job-dir", "j", str(SCRIPTS / "train_tiny.py"),
                     "--epochs", "1", "--out", "final.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    bad = cfrun_in_process(["export", "j", str(tmp_path / "missing" / "w.pt")], cwd=tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0] and "missing" in lines[0]
    assert not (tmp_path / "missing").exists()
    existing = tmp_path / "w.pt"
    existing.write_bytes(b"keep me")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        denied = cfrun_in_process(["export", "j", str(ro / "w.pt")], cwd=tmp_path)
    finally:
        ro.chmod(0o700)
    if denied.returncode == 0:  # root writes into a 0500 directory: nothing to check
        return
    assert denied.returncode == 2 and len(denied.stderr.strip().splitlines()) == 1
    assert list(ro.iterdir()) == []
    ok = cfrun_in_process(["export", "j", str(existing)], cwd=tmp_path)
    assert ok.returncode == 0 and existing.read_bytes() != b"keep me"


@pytest.mark.torchrun  # torchrun's logs are the point
@pytest.mark.parametrize("log_format", ["auto", pytest.param("json", marks=pytest.mark.extended)])
@pytest.mark.slow
def test_a_crash_and_restart_off_a_terminal_is_one_line_each_and_torchrun_logs_go_to_the_job_dir(
        tmp_path, log_format):
    """Not on a terminal: one record per line, never wrapped, no trailing blanks; the rank's
    SIGKILL named; torchrun's ChildFailedError report kept in logs/attempt-0.log, not printed;
    torchrun's --log-dir inside the job dir (no torchelastic_* directory in /tmp)."""
    run = run_cfrun(["--interval", "10", "--job-dir", "j", "--inject-crash", "30",
                     "--log-format", log_format, str(SCRIPTS / "train_tiny.py"), "--epochs", "2",
                     "--out", "final.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr
    assert all(line == line.rstrip() for line in lines), [ln for ln in lines if ln != ln.rstrip()]
    assert not [ln for ln in lines if ln.startswith(" ")], run.stderr  # no wrapped continuation
    if log_format == "json":
        records = [json.loads(ln) for ln in lines if ln.startswith("{")]
        assert records and all(set(r) == {"t_unix_s", "level", "logger", "message"}
                               for r in records)
        restarts = [r["message"] for r in records if "restart 1 of" in r["message"]]
    else:
        restarts = [ln for ln in lines if "restart 1 of" in ln]
        assert restarts and restarts[0].startswith("WARNING cfrun: training failed")
    assert len(restarts) == 1 and "rank 0 killed by SIGKILL" in restarts[0], run.stderr
    [failure] = run.events("failure")
    assert failure["cause"] == "rank 0 killed by SIGKILL"
    log = (tmp_path / "j" / "logs" / "attempt-0.log").read_text()
    assert "ChildFailedError" in log and "Signal 9 (SIGKILL)" in log
    assert (tmp_path / "j" / "logs" / "attempt-0.log").stat().st_mode & 0o077 == 0
    [argv] = [e["argv"] for e in run.events("attempt_start")][:1]
    log_dir = tmp_path / "j" / "logs" / "torchrun"
    assert f"--log-dir={log_dir}" in argv
    assert len(list(log_dir.iterdir())) == 2  # one torchrun run directory per attempt


LAUNCH_OPTIONS = ("--launcher", "--nproc-per-node", "--local-addr", "--standalone",
                  "--master-addr", "--master-port", "--rdzv-backend", "--rdzv-conf")
"""The options of ``cfrun SCRIPT`` that change how the script starts on one node."""


@pytest.mark.parametrize("command", ["profile", "verify"])
def test_profile_and_verify_take_the_launch_options_from_the_run_commands_definition(command):
    """Issue 37, item 1: the same names, variables, defaults and help as ``cfrun SCRIPT``."""
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]

    def by_option(name: str) -> dict:
        return {o: p for p in commands[name].params for o in getattr(p, "opts", [])}

    run, other = by_option("run"), by_option(command)
    for option in LAUNCH_OPTIONS:
        assert option in other, option
        a, b = run[option], other[option]
        assert (a.opts, a.envvar, a.metavar, a.default, a.help) == \
            (b.opts, b.envvar, b.metavar, b.default, b.help), option


@pytest.mark.parametrize("command", ["profile", "verify"])
@pytest.mark.parametrize("given", [["--launcher", "mpirun"], ["--tee", "3"],
                                   ["--rdzv-backend", "etcd"]], ids=["flag", "dropped",
                                                                     "backend"])
def test_profile_and_verify_check_the_launch_options_as_run_does(tmp_path, command, given):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    run = cfrun_in_process([command, *given, str(script)], cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("cfrun: error:") and given[0] in line, line
    assert list(tmp_path.iterdir()) == [script]


@pytest.mark.parametrize("command", ["profile", "verify"])
def test_profile_and_verify_read_the_launchers_variable(tmp_path, command):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    run = cfrun_in_process([command, str(script)], cwd=tmp_path,
                           env={"CFRUN_LAUNCHER": "mpirun"})
    assert run.returncode == 2 and "--launcher 'mpirun'" in run.stderr, run.stderr


@pytest.mark.parametrize("typed, line", [
    (["train.py", "--lr", "1"], "cfrun --launcher python train.py --lr 1"),
    (["run", "--launcher", "torchrun", "--interval", "5", "train.py", "--launcher", "x"],
     "cfrun run --launcher python --interval 5 train.py --launcher x"),
    (["--launcher=torchrun", "--standalone", "-m", "pkg.train"],
     "cfrun --launcher python --standalone -m pkg.train"),
    (["verify", "--steps", "9", "--launcher", "torchrun", "--interval", "5", "my t.py"],
     "cfrun verify --launcher python --steps 9 --interval 5 'my t.py'"),
    (["profile", "--job-dir", "--launcher", "t.py"],  # a job dir named --launcher
     "cfrun profile --launcher python --job-dir --launcher t.py"),
])
def test_the_python_launcher_line_is_the_command_as_typed(typed, line):
    import click

    from cfrun.cli.argv import python_launcher_line

    name = typed[0] if typed[0] in ("run", "profile", "verify") else "run"
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    ctx = click.Context(command, obj={"argv": typed})
    assert python_launcher_line(ctx) == line
