"""Unit tests of the local trust boundary (issue 12, items 5 and 6) that need no second user:
what ``cfrun run`` records of the environment and what ``cfrun resume`` takes back, the agent's
record, and the private slot files and their cleanup."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cfrun.cli import app as A
from cfrun.cli import recorded_env as R
from cfrun.cli import resume
from cfrun.contract import ipc, slots
from cfrun.contract.config import RunConfig
from cfrun.contract.jobdir import JobDir


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------- config.json is data

def test_recorded_env_keeps_names_not_values_of_credentials(monkeypatch) -> None:
    for k in list(os.environ):
        monkeypatch.delenv(k)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("CFRUN_PERSIST_TO", "s3://alice:hunter2@minio.local:9000/bucket")
    monkeypatch.setenv("CFRUN_PEER_TOKEN_FILE", "/home/alice/token")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5")
    monkeypatch.setenv("CUDA_API_KEY", "k")
    monkeypatch.setenv("MKL_AUTH_HEADER", "Bearer x")
    monkeypatch.setenv("CFRUN_SESSION_ID", "s")
    monkeypatch.setenv("PYTHONPATH", "/evil")
    monkeypatch.setenv("PYTHONSTARTUP", "/evil.py")
    monkeypatch.setenv("LD_PRELOAD", "/evil.so")
    monkeypatch.setenv("NCCL_NET_PLUGIN", "/evil.so")
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/evil.so")
    monkeypatch.setenv("CFRUN_RANK_JOB_DIR", "/j")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never")
    env = R.recorded_env()
    assert env == {"OMP_NUM_THREADS": "3", "NCCL_IB_HCA": "mlx5",
                   "CFRUN_PERSIST_TO": R.WITHHELD, "CFRUN_PEER_TOKEN_FILE": R.WITHHELD,
                   "CUDA_API_KEY": R.WITHHELD, "MKL_AUTH_HEADER": R.WITHHELD,
                   "CFRUN_SESSION_ID": R.WITHHELD}
    assert "hunter2" not in json.dumps(env)


def test_resumable_env_refuses_interpreter_and_loader_variables() -> None:
    keep, refused, withheld = R.resumable_env({
        "OMP_NUM_THREADS": "3", "PYTHONPATH": "/evil", "PYTHONSTARTUP": "/e.py",
        "LD_PRELOAD": "/e.so", "LD_LIBRARY_PATH": "/e", "DYLD_INSERT_LIBRARIES": "/e",
        "NCCL_NET_PLUGIN": "/e.so", "CFRUN_PREV_PYTHONPATH": "/e", "BASH_ENV": "/e.sh",
        "CFRUN_RANK_SETTINGS": "{}", "CUDA_VISIBLE_DEVICES": 0,
        "CFRUN_PEER_TOKEN_FILE": R.WITHHELD})
    assert keep == {"OMP_NUM_THREADS": "3"}
    assert refused == sorted(["PYTHONPATH", "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH",
                              "DYLD_INSERT_LIBRARIES", "NCCL_NET_PLUGIN", "CFRUN_PREV_PYTHONPATH",
                              "BASH_ENV", "CFRUN_RANK_SETTINGS", "CUDA_VISIBLE_DEVICES"])
    assert withheld == ["CFRUN_PEER_TOKEN_FILE"]


def test_resumable_env_is_an_allowlist_of_knobs() -> None:
    """Issue 24, item 8: these passed the name filter and chose code or targets on resume."""
    chosen = ["NCCL_CONF_FILE", "NCCL_DEBUG_FILE", "NCCL_TOPO_DUMP_FILE", "OMP_TOOL_LIBRARIES",
              "CUDA_CACHE_PATH", "CFRUN_FAULTS", "CFRUN_S3_ENDPOINT_URL", "CFRUN_SHM_DIR",
              "NCCL_SOCKET_IFNAME_FILE", "OMP_DISPLAY_ENV"]
    knobs = {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1",
             "OMP_NUM_THREADS": "4", "CFRUN_OVERHEAD": "3.5%"}
    keep, refused, _ = R.resumable_env({**{k: "/x" for k in chosen}, **knobs})
    assert keep == knobs and refused == sorted(chosen)


def test_a_password_in_persist_to_is_nowhere_on_disk_and_resume_asks_for_it(
        tmp_path, monkeypatch) -> None:
    """Issue 24, item 7: config.json kept ``--persist-to s3://u:pw@...`` whole (and the agent's
    command line showed it). config.json now has the password withheld; ``cfrun resume`` asks
    for the URL again in one line, and takes it from CFRUN_PERSIST_TO."""
    from cfrun.contract.config import redact_url

    url = "s3://alice:hunter2@minio.local:9000/bucket"
    assert redact_url(url) == "s3://alice:<withheld>@minio.local:9000/bucket"
    assert redact_url("s3://bucket/p") == "s3://bucket/p"
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    jd = JobDir(tmp_path / "job")
    jd.create()
    cfg = RunConfig(script=str(script), script_args=[], job_dir=str(jd.root),
                    cwd=str(tmp_path), persist_to=redact_url(url))
    jd.config_path.write_text(json.dumps(cfg.to_json()))
    monkeypatch.delenv("CFRUN_PERSIST_TO", raising=False)
    seen: dict = {}
    monkeypatch.setattr(resume, "run_job", lambda c, **kw: seen.update(cfg=c))
    refused = CliRunner().invoke(A.app, ["resume", str(jd.root)])
    from cfrun.contract.errors import BadInputError

    assert isinstance(refused.exception, BadInputError)  # exit 2 through cfrun's main()
    said = str(refused.exception)
    assert "CFRUN_PERSIST_TO=URL cfrun resume" in said and "\n" not in said
    assert "hunter2" not in said + refused.output and not seen
    monkeypatch.setenv("CFRUN_PERSIST_TO", url)
    ok = CliRunner().invoke(A.app, ["resume", str(jd.root)])
    assert ok.exit_code == 0, ok.output
    assert seen["cfg"].persist_to == url and "hunter2" not in ok.output
    assert "persist-to s3://alice:<withheld>@minio.local:9000/bucket" in ok.output


def test_resume_ignores_an_edited_pythonpath_and_prints_the_command(tmp_path, monkeypatch):
    """An edited config.json with PYTHONPATH and LD_PRELOAD: ``cfrun resume`` names them in one
    warning line, leaves them unset, sets the recorded OMP_NUM_THREADS, and prints the command
    it resumes in one line."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    jd = JobDir(tmp_path / "job")
    jd.create()
    cfg = RunConfig(script=str(script), script_args=["--lr", "0.1 0.2"], job_dir=str(jd.root),
                    cwd=str(tmp_path), env={"OMP_NUM_THREADS": "3", "PYTHONPATH": "/evil",
                                            "LD_PRELOAD": "/evil.so"})
    jd.config_path.write_text(json.dumps(cfg.to_json()))
    for k in ("OMP_NUM_THREADS", "PYTHONPATH", "LD_PRELOAD"):
        monkeypatch.delenv(k, raising=False)
    seen: dict = {}
    monkeypatch.setattr(resume, "run_job", lambda c, **kw: seen.update(
        cfg=c, env={k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH",
                                                     "LD_PRELOAD")}))
    result = CliRunner().invoke(A.app, ["resume", str(jd.root)])
    assert result.exit_code == 0, result.output
    assert seen["env"] == {"OMP_NUM_THREADS": "3", "PYTHONPATH": None, "LD_PRELOAD": None}
    lines = result.output.splitlines()
    warned = [line for line in lines if "ignoring" in line]
    assert len(warned) == 1 and "LD_PRELOAD, PYTHONPATH" in warned[0]
    resumed = [line for line in lines if line.startswith("cfrun: resuming:")]
    assert resumed == [(f"cfrun: resuming: {script} --lr '0.1 0.2' in {tmp_path} (job dir "
                       f"{jd.root}, 1 rank(s) per node, persist-to none, peer none)")]


# ---------------------------------------------------------------- agent record, slots

def test_agent_record_is_private_and_never_read_through_a_link(tmp_path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.create()
    rec = ipc.AgentRecord(os.getpid(), ipc.new_agent_address(), "/dev/shm/x")
    ipc.write_agent_record(jd.root, rec)
    assert ipc.read_agent_record(jd.root) == rec and _mode(jd.agent_path) == 0o600
    assert ipc.new_agent_address() != rec.address and len(rec.address) == 12 + 32
    jd.agent_path.unlink()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"pid": 1, "address": ipc.new_agent_address()}))
    jd.agent_path.symlink_to(other)
    with pytest.raises(ipc.RefusedPeer, match="symbolic link"):
        ipc.read_agent_record(jd.root)
    jd.agent_path.unlink()
    jd.agent_path.write_text(json.dumps({"pid": 1, "address": "\0evil"}))
    with pytest.raises(ipc.RefusedPeer, match="malformed"):
        ipc.read_agent_record(jd.root)
    ipc.write_agent_record(jd.root, rec)  # replaces whatever is there, never writes through
    assert ipc.read_agent_record(jd.root) == rec


def test_slots_are_private_exclusive_and_unpredictable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(slots.ENV_SHM_DIR, str(tmp_path / "shm"))
    job = tmp_path / "job"
    d1, d2 = slots.create_dir(job), slots.create_dir(job)
    assert d1 is not None and d2 is not None and d1 != d2
    assert d1.name.startswith(slots.dir_prefix(job) + "_") and _mode(d1) == 0o700
    a, b = slots.create_slot(d1, 0, 8192), slots.create_slot(d1, 0, 8192)
    assert a != b and _mode(a) == 0o600 and a.stat().st_size == 8192
    slots.ensure_private(d1)
    d1.chmod(0o755)
    with pytest.raises(slots.SlotRefused, match="mode 755"):
        slots.ensure_private(d1)
    d1.chmod(0o700)
    link = tmp_path / "shm" / "linked"
    link.symlink_to(d1)
    with pytest.raises(slots.SlotRefused, match="not a directory"):
        slots.ensure_private(link)
    fd = slots.open_slot(str(a), [d1], 8192)
    os.close(fd)
    with pytest.raises(slots.SlotRefused, match="not in this job's"):
        slots.open_slot(str(link / a.name), [d1], 1)


def test_cleanup_never_follows_links_nor_deletes_foreign_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(slots.ENV_SHM_DIR, str(tmp_path / "shm"))
    job = tmp_path / "job"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    mine = slots.create_dir(job)
    assert mine is not None
    slots.create_slot(mine, 0, 4096)
    (mine / "rank00000-1-x.slot").symlink_to(victim)
    foreign_dir = tmp_path / "shm" / (slots.dir_prefix(job) + "_theirs")
    foreign_dir.mkdir()
    (foreign_dir / "theirs.slot").write_text("theirs")
    (tmp_path / "shm" / (slots.dir_prefix(job) + "_link")).symlink_to(tmp_path)
    if os.getuid() == 0:
        os.chown(foreign_dir, 65534, 65534)
        os.chown(foreign_dir / "theirs.slot", 65534, 65534)
        foreign_in_mine = slots.create_slot(mine, 1, 1).rename(mine / "foreign.slot")
        os.chown(foreign_in_mine, 65534, 65534)
    slots.remove_dirs(job)
    assert victim.read_text() == "precious"
    assert (tmp_path / "shm" / (slots.dir_prefix(job) + "_link")).is_symlink()
    if os.getuid() == 0:
        assert (foreign_dir / "theirs.slot").read_text() == "theirs"
        assert [p.name for p in mine.iterdir()] == ["foreign.slot"]
    else:
        assert not mine.exists()


def test_dead_ranks_slots_are_removed_live_and_foreign_ones_kept(tmp_path) -> None:
    import subprocess

    d = tmp_path / "slots"
    slots.ensure_private(d)
    live = slots.create_slot(d, 0, 1)
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              check=False, capture_output=True, text=True).stdout.strip()
    dead = d / f"rank00001-{dead_pid}-abcd.slot"
    dead.write_bytes(b"x")
    link = d / f"rank00002-{dead_pid}-link.slot"
    link.symlink_to(tmp_path / "nowhere")
    foreign = d / f"rank00003-{dead_pid}-theirs.slot"
    foreign.write_bytes(b"y")
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)
    assert slots.remove_dead_slots([d]) == (2 if os.getuid() == 0 else 3)
    assert live.exists() and not dead.exists() and not link.is_symlink()
    assert foreign.exists() == (os.getuid() == 0)


def test_disk_accounting_never_walks_a_linked_checkpoints_dir(tmp_path) -> None:
    """Issue 24, item 10: ``cfrun status`` summed ``checkpoints/`` with ``os.walk``, which
    follows its top: linked to ``/`` it walked the machine (13 s). A linked top counts 0;
    a real one counts its regular files only."""
    from cfrun.contract.fsio import tree_bytes

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "big").write_bytes(b"x" * 1000)
    (tmp_path / "checkpoints").symlink_to(elsewhere)
    assert tree_bytes(tmp_path / "checkpoints") == 0
    real = tmp_path / "real"
    real.mkdir()
    (real / "a").write_bytes(b"y" * 10)
    (real / "link").symlink_to(elsewhere / "big")
    assert tree_bytes(real) == 10


def test_level2_directories_are_private(tmp_path) -> None:
    """Issue 24, item 10: level-2 directories were 0755 (the README says 0700): another local
    user listed and read a job's checkpoints there."""
    import stat as st

    import xxhash

    from cfrun.contract.manifest import FileEntry, Manifest
    from cfrun.storage.tiers import open_storage

    old = os.umask(0o022)
    try:
        store = open_storage(str(tmp_path / "l2"))
        w = store.begin("job", 10)
        w.write_file("rank-00000.bin", [b"abc"])
        w.commit(Manifest.build(10, 1, [FileEntry("rank-00000.bin", 3,
                                                  xxhash.xxh3_64_hexdigest(b"abc"))]))
    finally:
        os.umask(old)
    for d in (tmp_path / "l2" / "job", tmp_path / "l2" / "job" / "step-000010"):
        assert st.S_IMODE(d.stat().st_mode) == 0o700, d


@pytest.mark.parametrize("mode,ok", [(0o755, "yes"), (0o1777, "yes"), (0o2775, "warned"),
                                     (0o757, "no"), (0o777, "no")])
def test_a_job_dir_under_a_directory_others_may_write_is_refused(tmp_path, capfd, monkeypatch,
                                                                 mode, ok) -> None:
    """Issue 24, item 3: whoever can write an ancestor can rename a running job's dir away
    and plant their own; the next restart loaded its checkpoint. Like OpenSSH's StrictModes:
    other-writable ancestors are refused unless sticky (/tmp); a group-writable one (a
    setgid project dir, a Kubernetes fsGroup volume) is warned about when the job dir is made,
    the warning saying what guards the job (issue 32, finding 2: every rank checks the job
    dir's identity before it reads it; manifests need the job's MAC)."""
    from cfrun.contract.errors import BadInputError
    from cfrun.contract.jobdir import JobDir

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    jd = JobDir(shared / "cfrun-jobs" / "j")
    if ok == "no":
        with pytest.raises(BadInputError, match="could swap the job dir") as e:
            jd.check_usable()
        assert "chmod o-w" in str(e.value) and "\n" not in str(e.value)
    else:
        jd.check_usable()
        err = capfd.readouterr().err
        assert ("writable by its group" in err) == (ok == "warned"), err
        if ok == "warned":
            assert "every rank checks its identity" in err and f"chmod g-w {shared}" in err


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")
def test_a_job_dir_under_another_users_directory_is_refused(tmp_path) -> None:
    from cfrun.contract.errors import BadInputError
    from cfrun.contract.jobdir import JobDir

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(BadInputError, match="owned by uid 65534"):
        JobDir(theirs / "j").check_usable()


def test_resume_takes_back_no_nccl_address_and_no_metrics_port_open_to_the_network(
        tmp_path, monkeypatch) -> None:
    """Issue 32, finding 6: ``NCCL_COMM_ID``, ``NCCL_RAS_ADDR`` and ``--metrics 0.0.0.0:9100``
    in an edited config.json were taken back silently (the ranks' rendezvous and a metrics
    port steered by the job dir). Now the variables are in the one warning line and left
    unset, and the metrics address is dropped with one line, unless ``CFRUN_METRICS`` gives
    it again; a loopback address is kept."""
    keep, refused, _ = R.resumable_env({"NCCL_COMM_ID": "10.9.9.9:1234",
                                        "NCCL_RAS_ADDR": "10.9.9.9:1235", "NCCL_IB_HCA": "m"})
    assert keep == {"NCCL_IB_HCA": "m"} and refused == ["NCCL_COMM_ID", "NCCL_RAS_ADDR"]
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    jd = JobDir(tmp_path / "job")
    jd.create()
    for k in ("NCCL_COMM_ID", "NCCL_RAS_ADDR", "CFRUN_METRICS"):
        monkeypatch.delenv(k, raising=False)
    seen: dict = {}
    monkeypatch.setattr(resume, "run_job", lambda c, **kw: seen.update(
        cfg=c, env={k: os.environ.get(k) for k in ("NCCL_COMM_ID", "NCCL_RAS_ADDR")}))

    def resumed(metrics: str) -> list[str]:
        cfg = RunConfig(script=str(script), script_args=[], job_dir=str(jd.root),
                        cwd=str(tmp_path), metrics=metrics,
                        env={"NCCL_COMM_ID": "10.9.9.9:1234", "NCCL_RAS_ADDR": "10.9.9.9:1"})
        jd.config_path.write_text(json.dumps(cfg.to_json()))
        result = CliRunner().invoke(A.app, ["resume", str(jd.root)])
        assert result.exit_code == 0, result.output
        return [line for line in result.output.splitlines() if "warning" in line]

    warned = resumed("0.0.0.0:9100")
    assert seen["cfg"].metrics is None
    assert seen["env"] == {"NCCL_COMM_ID": None, "NCCL_RAS_ADDR": None}
    assert len(warned) == 2 and "NCCL_COMM_ID, NCCL_RAS_ADDR" in warned[0]
    assert "'0.0.0.0:9100'" in warned[1] and "CFRUN_METRICS=HOST:PORT cfrun resume" in warned[1]
    assert len(resumed("127.0.0.1:9100")) == 1 and seen["cfg"].metrics == "127.0.0.1:9100"
    monkeypatch.setenv("CFRUN_METRICS", "0.0.0.0:9200")  # the user's choice, now
    assert len(resumed("0.0.0.0:9100")) == 1 and seen["cfg"].metrics == "0.0.0.0:9200"
