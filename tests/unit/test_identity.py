"""Unit tests for the job's identity (cfrun.contract.config): the command's fingerprint, the
default job dir and job name, and check_identity's decisions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cfrun.contract.config import (
    ACCEPTED,
    NO_CHECKPOINT,
    Command,
    Identity,
    RunConfig,
    WorldSizeRefusedError,
    check_identity,
    check_job_name,
    default_job_dir,
    default_job_name,
    job_id_of,
    resume_command,
)
from cfrun.contract.errors import BadInputError, ChangedCommandError
from cfrun.storage.tiers import check_job_name as storage_job_name


def _command(tmp_path: Path, args: list[str], *, text: str = "print(1)\n", nproc: int = 1,
             name: str = "train.py") -> Command:
    script = tmp_path / name
    script.write_text(text)
    return Command.of(RunConfig(script=str(script), script_args=args,
                                job_dir=str(tmp_path / "j"), cwd=str(tmp_path),
                                nproc_per_node=nproc))


def test_default_job_dir_differs_for_one_file_name_in_two_directories(tmp_path: Path) -> None:
    a = default_job_dir("a/train.py", tmp_path)
    b = default_job_dir("b/train.py", tmp_path)
    assert a != b and a.parent == b.parent == tmp_path / "cfrun-jobs"
    assert a.name.startswith("train-") and b.name.startswith("train-")
    assert default_job_dir(str(tmp_path / "a" / "train.py"), tmp_path) == a  # stable


def test_default_job_dir_differs_for_other_arguments_or_world_sizes(tmp_path: Path) -> None:
    """A learning-rate sweep in one directory: one job dir per command, the same every time."""
    script = "train.py"
    plain = default_job_dir(script, tmp_path)
    dirs = [plain, default_job_dir(script, tmp_path, ["--lr", "0.1"]),
            default_job_dir(script, tmp_path, ["--lr", "0.2"]),
            default_job_dir(script, tmp_path, ["--lr", "0.1"], nproc_per_node=2),
            default_job_dir(script, tmp_path, ["--lr", "0.1"], nproc_per_node=1, nnodes=2)]
    assert len(set(dirs)) == len(dirs) and all(d.name.startswith("train-") for d in dirs)
    assert default_job_dir(script, tmp_path, ["--lr", "0.1"]) == dirs[1]  # stable
    assert default_job_dir(script, tmp_path, [], 1, 1) == plain


def test_a_job_dir_named_by_the_script_alone_keeps_its_job(tmp_path: Path) -> None:
    """An older cfrun named the job dir by the script's path alone: the command it holds
    (identity.json) still finds it; another command gets its own."""
    legacy = default_job_dir("train.py", tmp_path)
    legacy.mkdir(parents=True)
    cmd = _command(tmp_path, ["--lr", "0.1"])
    ident, _, _ = check_identity(legacy / "identity.json", cmd, job_name=None,
                                 accept_changed=False)
    (legacy / "identity.json").write_text(json.dumps(ident.to_json()))
    assert default_job_dir("train.py", tmp_path, ["--lr", "0.1"]) == legacy
    assert default_job_dir("train.py", tmp_path, ["--lr", "0.2"]) != legacy
    assert default_job_dir("train.py", tmp_path, ["--lr", "0.1"], nproc_per_node=2) != legacy


def test_resume_command_quotes_the_job_dir_and_names_other_nodes() -> None:
    assert resume_command("/w/j") == "cfrun resume /w/j"
    assert resume_command("/w/my job", 0, "--rerun") == "cfrun resume --rerun '/w/my job'"
    assert resume_command("/w/j", 2, "--accept-changed-command") == \
        "cfrun resume --accept-changed-command --node-rank 2 /w/j"


@pytest.mark.parametrize("job_dir", ["j", "my job", "..x", "-lead", "ünï", "a" * 300])
def test_default_job_name_is_a_valid_storage_name(tmp_path: Path, job_dir: str) -> None:
    name = default_job_name(tmp_path / job_dir)
    assert storage_job_name(name) == name and check_job_name(name) == name


def test_default_job_name_keeps_apart_job_dirs_with_one_name(tmp_path: Path) -> None:
    x, y = default_job_name(tmp_path / "x" / "j"), default_job_name(tmp_path / "y" / "j")
    assert x != y and x.startswith("j-") and y.startswith("j-")
    assert default_job_name(tmp_path / "x" / "j") == x  # a fresh node, the same path: the same


def test_several_nodes_check_only_the_job_id(tmp_path: Path) -> None:
    """The nodes of a job may run other arguments (an output file per node): any node's
    fingerprint in a manifest is the job's."""
    cmd = _command(tmp_path, ["got0.pt"])
    ident, _, _ = check_identity(tmp_path / "identity.json", cmd, job_name="m",
                                 accept_changed=False, nnodes=2)
    assert ident.refusal({"job_id": ident.job_id, "command": "node 1's"}) is None
    assert ident.refusal({"job_id": job_id_of("other"), "command": cmd.fingerprint})


def test_check_identity_new_same_changed_accepted(tmp_path: Path) -> None:
    path = tmp_path / "j" / "identity.json"
    path.parent.mkdir()
    cmd = _command(tmp_path, ["--lr", "0.1", "--out", "o.pt"])
    ident, changes, write = check_identity(path, cmd, job_name=None, accept_changed=False)
    assert write and not changes and ident.job_id == job_id_of(ident.job_name)
    path.write_text(json.dumps(ident.to_json()))
    assert check_identity(path, cmd, job_name=None, accept_changed=False) == (ident, [], False)
    lr = _command(tmp_path, ["--lr", "0.2", "--out", "o.pt"])
    with pytest.raises(BadInputError, match=r"argument --lr: 0\.1 -> 0\.2\. To start a new job"):
        check_identity(path, lr, job_name=None, accept_changed=False)
    edited = _command(tmp_path, ["--lr", "0.1", "--out", "o.pt"], text="print(2)\n")
    with pytest.raises(BadInputError, match=r"script edited \(sha256"):
        check_identity(path, edited, job_name=None, accept_changed=False)
    wider = _command(tmp_path, ["--lr", "0.1", "--out", "o.pt"], nproc=2)
    for accept in (False, True):  # another world size: only --reshard goes on (exit 5)
        with pytest.raises(WorldSizeRefusedError,
                           match="written by 1 ranks and this run has 2: add --reshard"):
            check_identity(path, wider, job_name=None, accept_changed=accept)
    took, changes, write = check_identity(path, wider, job_name=None, accept_changed=False,
                                          reshard=True)
    assert write and changes == ["world size 1 -> 2"] and took.job_id == ident.job_id
    assert took.changes[-1]["why"] == "--reshard"
    assert took.fingerprints == (cmd.fingerprint, wider.fingerprint)
    assert check_identity(path, wider, job_name=None, accept_changed=False,
                          resumable=False)[1] == ["world size 1 -> 2"]  # nothing to resume
    with pytest.raises(BadInputError, match="job name .* -> other"):
        check_identity(path, cmd, job_name="other", accept_changed=False)
    new, changes, write = check_identity(path, lr, job_name=None, accept_changed=True)
    assert write and changes == ["argument --lr: 0.1 -> 0.2"]
    assert (new.job_id, new.job_name) == (ident.job_id, ident.job_name)
    assert new.fingerprints == (cmd.fingerprint, lr.fingerprint)
    assert new.refusal({"job_id": ident.job_id, "command": cmd.fingerprint}) is None
    assert "another job" in str(new.refusal({"job_id": "0" * 32, "command": cmd.fingerprint}))
    assert "another command" in str(new.refusal({"job_id": ident.job_id, "command": "f" * 64}))
    assert "another job (job id none" in str(new.refusal({}))
    assert Identity.from_json(new.to_json(), "x") == new


def test_a_changed_command_without_a_checkpoint_is_taken(tmp_path: Path) -> None:
    """Nothing to resume: the new command is the job's (old fingerprints dropped), recorded
    with why; with a checkpoint the same change is refused."""
    path = tmp_path / "identity.json"
    helped = _command(tmp_path, ["-h"])
    ident, _, _ = check_identity(path, helped, job_name=None, accept_changed=False)
    path.write_text(json.dumps(ident.to_json()))
    real = _command(tmp_path, ["--epochs", "4"])
    with pytest.raises(ChangedCommandError, match="add --accept-changed-command$"):
        check_identity(path, real, job_name=None, accept_changed=False, resumable=True)
    new, changes, write = check_identity(path, real, job_name=None, accept_changed=False,
                                         resumable=False)
    assert write and changes == ["arguments -h -> --epochs 4"]
    assert (new.job_id, new.job_name) == (ident.job_id, ident.job_name)
    assert new.fingerprints == (real.fingerprint,) and new.command == real
    assert new.changes[-1]["why"] == NO_CHECKPOINT and new.changes[-1]["changed"] == changes
    assert "another command" in str(new.refusal(ident.meta()))  # the old command's: refused
    accepted, _, _ = check_identity(path, real, job_name=None, accept_changed=True)
    assert accepted.changes[-1]["why"] == ACCEPTED


def test_an_accepted_rename_keeps_the_old_checkpoints_the_jobs(tmp_path: Path) -> None:
    path = tmp_path / "identity.json"
    cmd = _command(tmp_path, [])
    ident, _, _ = check_identity(path, cmd, job_name="a", accept_changed=False)
    path.write_text(json.dumps(ident.to_json()))
    renamed, changes, _ = check_identity(path, cmd, job_name="b", accept_changed=True)
    assert changes == ["job name a -> b"] and renamed.job_id == job_id_of("b")
    assert renamed.owns(ident.job_id) and renamed.owns(renamed.job_id)


def test_an_unreadable_identity_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "identity.json"
    path.write_text("{not json")
    with pytest.raises(BadInputError, match="identity.json is unreadable"):
        check_identity(path, _command(tmp_path, []), job_name=None, accept_changed=False)
    path.write_text(json.dumps({"format": 1, "job_id": "x"}))
    with pytest.raises(BadInputError, match="new --job-dir"):
        check_identity(path, _command(tmp_path, []), job_name=None, accept_changed=False)
