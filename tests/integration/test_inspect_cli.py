"""cfrun status / ls / export on a real job dir, their JSON shapes, and their bad input.

The job dir is made by a real run (a crash, a resume); the inspection commands themselves run
in-process through typer's CliRunner (they only read files), except where another process is
the point (an exported file loaded without cfrun, a lock held by another process, a terminal)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import SCRIPTS, cfrun_in_process, run_cfrun, run_on_a_terminal, shared_run

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The directory holding job dir ``j``: one crash and a resume, then done (made once per
    session, whichever xdist worker asks first; read-only, tests copy it to change it). Its
    progress interval is short, so it also shows that a piped cfrun logs no progress lines."""
    return _piped_job(tmp_path_factory).cwd


def _piped_job(tmp_path_factory):
    def make(cwd):
        return run_cfrun(["--interval", "10", "--keep", "3", "--job-dir", "j", "--inject-crash",
                          "35", str(SCRIPTS / "train_tiny.py"), "--epochs", "2", "--out",
                          "final.pt"], cwd=cwd,  # under torchrun, as users launch it (one job)
                         env={"CFRUN_PROGRESS_S": "0.5", "CFRUN_LAUNCHER": "torchrun"})

    run = shared_run(tmp_path_factory, "inspect-job", make)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def _newest_committed_before_the_kill(job) -> int:
    """The step the crash's resume must come from, found from the job's events: the newest
    checkpoint of a step before the kill (35) committed before the resume (the agent may commit
    the one in flight after the rank died; the resume waits for it)."""
    events = [json.loads(x) for x in (job / "j" / "events.jsonl").read_text().splitlines()]
    resumed = next(e["t_unix_s"] for e in events if e["event"] == "resumed"
                   and e["attempt"] == 1 and e.get("rank", 0) == 0)
    return max(e["step"] for e in events if e["event"] == "commit" and e["step"] <= 35
               and e["t_unix_s"] <= resumed)


def test_status_json_shape(job):
    run = cfrun_in_process(["status", "j", "--json"], cwd=job)
    assert run.returncode == 0, run.stderr
    st = json.loads(run.stdout)
    assert st["state"] == "succeeded" and st["is_running"] is False
    assert st["current_step"] == 46 and st["last_committed_step"] >= 40
    assert st["interval"] == {"steps": 10, "why": "fixed by --interval"}
    assert st["attempts"] == 2 and len(st["restarts"]) == 1
    assert st["restarts"][0]["cause"] == "rank 0 killed by SIGKILL"  # torchrun's report
    assert st["stall_s"]["count"] == st["checkpoints_taken"] >= 3
    assert set(st["pgt_s"]) == {"count", "median", "p95", "max"}
    assert st["disk_bytes"] > 0 and 0 <= st["overhead"]["stall_pct"] < 100
    resume = st["last_resume"]  # the crash's resume, broken down from the events
    # the newest checkpoint committed before the kill at 35 (which one depends on how busy the
    # machine was: a due checkpoint may be deferred; issue 36)
    assert resume["attempt"] == 1 and resume["step"] == _newest_committed_before_the_kill(job)
    phases = ("backoff_s", "launch_s", "import_s", "agent_wait_s", "read_s", "to_boundary_s",
              "restore_s")
    assert all(resume[p] is not None and resume[p] >= 0 for p in phases), resume
    assert resume["backoff_s"] < 0.5  # the crashed attempt had committed: no backoff
    assert sum(resume[p] for p in phases) == pytest.approx(resume["total_s"], abs=0.05)


def test_status_table_and_ls(job):
    table = cfrun_in_process(["status", "j"], cwd=job)
    assert table.returncode == 0 and "last committed step" in table.stdout
    assert "last resume" in table.stdout
    # the job's overhead before the interval's reason (a window's "over budget" read as a
    # contradiction of the overhead row below it: issue 37, item 7)
    labels = [line.split("│")[1].strip() for line in table.stdout.splitlines()
              if line.count("│") >= 2]
    assert labels.index("overhead") < labels.index("interval"), labels
    step = _newest_committed_before_the_kill(job)
    assert re.search(rf"attempt 1 at step {step}\b", table.stdout), table.stdout
    rows = json.loads(cfrun_in_process(["ls", "j", "--json"], cwd=job).stdout)
    assert [r["step"] for r in rows] == sorted((r["step"] for r in rows), reverse=True)
    assert len(rows) == 3 and all(r["verified"] == "ok" for r in rows)
    # the newest is the final checkpoint at the script's end: no data position
    assert rows[0]["final"] is True and rows[0]["epoch"] is None and rows[0]["bytes"] > 0
    assert rows[1]["final"] is False and rows[1]["epoch"] == 1
    assert set(rows[0]) == {"step", "epoch", "batches", "bytes", "age_s", "verified", "final"}
    assert f"{rows[0]['step']} (final)" in cfrun_in_process(["ls", "j"], cwd=job).stdout


def test_ls_reports_a_corrupt_checkpoint(job, tmp_path):
    import shutil

    shutil.copytree(job / "j", tmp_path / "j")
    newest = sorted((tmp_path / "j" / "checkpoints").glob("step-*"))[-1] / "rank-00000.bin"
    data = bytearray(newest.read_bytes())
    data[10] ^= 0xFF
    newest.write_bytes(bytes(data))
    rows = json.loads(cfrun_in_process(["ls", "j", "--json"], cwd=tmp_path).stdout)
    assert rows[0]["verified"].startswith("corrupt") and rows[1]["verified"] == "ok"


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_loads_without_cfrun(job, tmp_path, fmt):
    out = tmp_path / f"model.{fmt}"
    run = cfrun_in_process(["export", "j", str(out), "--format", fmt], cwd=job)
    assert run.returncode == 0, run.stderr
    loader = ("import torch; sd = torch.load(p, weights_only=True)" if fmt == "torch" else
              "from safetensors.torch import load_file; sd = load_file(p)")
    code = (f"import sys; p = {str(out)!r}; {loader}; "
            "print(len(sd), 'cfrun' in sys.modules, sorted(sd)[0])")
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    n, has_cfrun, first = p.stdout.split()
    assert has_cfrun == "False" and int(n) == 9 and first == "0.bias"
    # the newest checkpoint's weights, as cfrun stored them
    from cfrun.codec.checkpoint import committed_steps, load_shard
    from cfrun.contract.jobdir import step_dir_name

    ck = job / "j" / "checkpoints"
    state, _ = load_shard(ck / step_dir_name(committed_steps(ck)[0]), 0)
    if fmt == "torch":
        got = torch.load(out, weights_only=True)
        assert all(torch.equal(got[k], state["modules"][0][k]) for k in got)


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_export_follows_no_planted_link_and_respects_the_umask(job, tmp_path, fmt):
    """Issue 24, item 10: a link planted at the temporary name export used to predict
    (``.NAME.cfrun-tmp-PID``) made it overwrite the link's target; and the safetensors file
    was 0600 where the torch one was 0644 (issue 27, item 8). Now the temporary name is
    random and created exclusively, and a file export gets the umask's mode."""
    import os

    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "model.out"
    os.symlink(victim, tmp_path / f".{out.name}.cfrun-tmp-{os.getpid()}")
    old = os.umask(0o022)
    try:
        run = cfrun_in_process(["export", "j", str(out), "--format", fmt], cwd=job)
    finally:
        os.umask(old)
    assert run.returncode == 0, run.stderr
    assert victim.read_text() == "precious" and not out.is_symlink()
    if fmt != "dcp":
        assert out.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.glob(".model.out*")] == [f".model.out.cfrun-tmp-{os.getpid()}"]


def test_export_dcp_is_read_by_dcp_itself(job, tmp_path):
    """``--format dcp``: a torch.distributed.checkpoint directory that DCP's own loader and
    ``dcp_to_torch_save`` read in an interpreter without cfrun, equal to the checkpoint."""
    out = tmp_path / "model-dcp"
    run = cfrun_in_process(["export", "j", str(out), "--format", "dcp"], cwd=job)
    assert run.returncode == 0, run.stderr
    assert (out / ".metadata").is_file() and not list(tmp_path.glob(".model-dcp.*"))
    code = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        f"d = {str(out)!r}; dcp_to_torch_save(d, d + '.pt')\n"
        "sd = torch.load(d + '.pt', weights_only=True)\n"
        "into = {k: torch.zeros_like(v) for k, v in sd.items()}\n"
        "dcp.load(into, checkpoint_id=d, no_dist=True)\n"
        "assert all(torch.equal(into[k], sd[k]) for k in sd)\n"
        "print(len(sd), 'cfrun' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["9", "False"]
    from cfrun.codec.checkpoint import committed_steps, load_shard
    from cfrun.contract.jobdir import step_dir_name

    ck = job / "j" / "checkpoints"
    state, _ = load_shard(ck / step_dir_name(committed_steps(ck)[0]), 0)
    got = torch.load(f"{out}.pt", weights_only=True)
    assert got.keys() == state["modules"][0].keys()
    assert all(torch.equal(got[k], state["modules"][0][k]) for k in got)
    again = cfrun_in_process(["export", "j", str(out), "--format", "dcp"], cwd=job)
    assert again.returncode == 2 and "exists" in again.stderr  # never written over


@pytest.mark.parametrize("args, needle", [
    (["ls", "missing"], "does not exist"),
    (["status", "{scripts}"], "not a cfrun job dir"),
    (["export", "j", "x.pt", "--step", "7"], "--step 7 has no committed checkpoint"),
    (["export", "j", "x.pt", "--format", "onnx"], "--format 'onnx'"),
    (["export", "j", "x.pt", "--step", "abc"], "--step 'abc'"),
    (["resume", "missing"], "does not exist"),
])
def test_bad_input_to_commands(job, args, needle):
    argv = [a.format(scripts=str(SCRIPTS)) for a in args]
    run = cfrun_in_process(argv, cwd=job)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert needle in run.stderr and "Traceback" not in run.stderr
    assert not (job / "x.pt").exists()


def test_status_plot_writes_a_png(job, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "status.png"
    run = cfrun_in_process(["status", "j", "--plot", str(out)], cwd=job)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_progress_lines_on_a_terminal_only(tmp_path, tmp_path_factory):
    """Under a pseudo-terminal cfrun logs whole progress lines with the overhead against the
    budget, each in one write (one can land between the two writes of a script line under
    python -u: split there, both stay whole); piped, it stays quiet."""
    import os
    import re
    import sys

    args = [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j",
            str(SCRIPTS / "slow_steps.py"), "40", "o.pt", "0.05"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CFRUN_")}
    env["CFRUN_PROGRESS_S"] = "0.5"
    text = run_on_a_terminal(args, env, cwd=tmp_path).decode(errors="replace")
    # a script line that python -u writes in two parts ("step 9", then its newline) can have
    # a progress line land between them, on the same terminal line: split such a line there
    lines = [part for line in text.splitlines()
             for part in re.split(r"(?=cfrun: step \d+ (?:of \d+ )?\()", line) if part]
    progress = [l for l in lines if "steps/s" in l]
    assert progress and all("newest checkpoint step" in l for l in progress)
    odd = [l for l in progress if not re.fullmatch(
        # the loop's total and the ETA once a checkpoint read slow_steps.py's range(40)
        r"cfrun: step \d+ (of 40 )?\([\d.]+ steps/s(, ETA [^)]+)?\), newest checkpoint step "
        r"(\d+|none), overhead "
        r"[\d.]+% stalled \(budget 3\.50%, not applied: --interval\)", l)]
    assert not odd, (odd, text[-3000:])
    # the script's own lines come through whole and in order, none cut by a progress line
    script_lines = [l for l in lines if l.startswith("step ")]
    assert script_lines == [f"step {i}" for i in range(1, 41)], text
    piped = _piped_job(tmp_path_factory)  # CFRUN_PROGRESS_S=0.5, two attempts of seconds each
    assert piped.returncode == 0 and "steps/s" not in piped.stderr + piped.stdout
    assert max(e["duration_s"] for e in piped.events("attempt_end")) > 0.5


def _digest(root) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _edit_config(jd, **changes) -> None:
    cfg = json.loads((jd / "config.json").read_text())
    cfg.update(changes)
    (jd / "config.json").write_text(json.dumps(cfg))


_CMDS = {"status": ["status", "{d}"], "ls": ["ls", "{d}"], "export": ["export", "{d}", "x.pt"],
         "resume": ["resume", "{d}"]}


def _matrix():
    for cmd in _CMDS:
        yield cmd, "missing", 2, "does not exist"
        yield cmd, "not a job dir", 2, "not a cfrun job dir"
    yield "export", "no such step", 2, "--step 7 has no committed checkpoint"
    yield "resume", "locked", 3, "in use by another cfrun"
    yield "resume", "corrupt config", 2, "is unreadable"
    yield "resume", "config not an object", 2, "is unreadable"
    yield "resume", "script gone", 2, "the recorded script"
    yield "resume", "cwd gone", 2, "the recorded working directory"


@pytest.mark.parametrize("cmd, case, code, needle", list(_matrix()))
def test_bad_job_dir_for_every_command(job, tmp_path, cmd, case, code, needle):
    """One line (plus a hint), the documented exit code (2 bad input, 3 locked), nothing
    changed in the directory given. In-process (typer's CliRunner), except the lock case: its
    holder must be another process."""
    import shutil

    from cfrun.contract.jobdir import JobDir

    target = tmp_path / "d"
    holder = None
    if case == "not a job dir":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif case != "missing":
        shutil.copytree(job / "j", target)
    if case == "corrupt config":
        (target / "config.json").write_text('{"script": "tr')
    elif case == "config not an object":
        (target / "config.json").write_text("[1, 2]")
    elif case == "script gone":
        _edit_config(target, script=str(tmp_path / "gone.py"))
    elif case == "cwd gone":
        _edit_config(target, cwd=str(tmp_path / "gone"))
    elif case == "locked":
        holder = JobDir(target)
        holder.lock()
    before = _digest(target) if target.exists() else None
    args = [a.format(d=str(target)) for a in _CMDS[cmd]]
    if case == "no such step":
        args += ["--step", "7"]
    try:
        if holder is not None:
            run = run_cfrun(args, cwd=tmp_path, timeout=300)
        else:
            run = cfrun_in_process(args, cwd=tmp_path)
    finally:
        if holder is not None:
            holder.unlock()
    assert run.returncode == code, (run.stdout, run.stderr[-2000:])
    lines = [l for l in run.stderr.splitlines() if l.strip()]
    assert lines[0].startswith("cfrun: error:") and needle in lines[0], run.stderr
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint:")), run.stderr
    assert "Traceback" not in run.stderr
    assert (_digest(target) if target.exists() else None) == before
    assert not (tmp_path / "x.pt").exists()
