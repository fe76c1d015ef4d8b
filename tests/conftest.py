"""Shared helpers: run cfrun as a real process or in-process, share uninterrupted reference
runs between tests and xdist workers, compare saved states bit for bit."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
EXAMPLES = ROOT / "examples"


def manual_text() -> str:
    """The manual as one text: README.md (the front page) and every page of the docs site
    (``docs/**/*.md``, built by mkdocs.yml). Tests that check what the manual says read this,
    so a fact may live on whichever page is its subject."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(page.read_text() for page in pages)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    job_dir: Path
    cwd: Path | None = None  # where it ran (shared reference runs: their output files)

    def events(self, kind: str | None = None) -> list[dict]:
        path = self.job_dir / "events.jsonl"
        if not path.exists():
            return []
        out = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        return [e for e in out if kind is None or e["event"] == kind]

    def final_steps(self) -> set[int]:
        """Steps of the final checkpoints committed at the script's end (issue 27, item 2):
        committed like any other (``commit``, ``protected``, ``durable`` events) but with a
        ``final_checkpoint`` event instead of a ``checkpoint`` one, at whatever step the
        script ended (not a multiple of the interval)."""
        return {e["step"] for e in self.events("final_checkpoint")
                if e.get("outcome") == "committed"}


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process a test starts: this one's less every ``CFRUN_*`` variable,
    one OMP thread, ``CFRUN_STANDBY=0`` where the test keeps no warm spares (:func:`_spares`),
    then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CFRUN_")}
    env["OMP_NUM_THREADS"] = "1"
    if not SPARES["on"]:
        env["CFRUN_STANDBY"] = "0"
    env.update(extra or {})
    return env


SPARES = {"on": os.environ.get("TESTS_SPARES") != "0"}
"""Whether the jobs of the running test keep warm spares (:func:`_spares`); outside a test
(a fixture shared by a module), unless ``TESTS_SPARES=0``."""


@pytest.fixture(autouse=True)
def _spares(request: pytest.FixtureRequest) -> Iterator[None]:
    """cfrun's jobs run as users run them, with warm spares (:mod:`cfrun.supervisor.standby`),
    except under torchrun. A rank's spare costs nothing after the first: the first attempt's
    rank starts as a spare, which forks the next spare at its go, before the script runs, so
    a job imports torch once however often it restarts (measured here: a one-rank job killed
    twice, 14.5 CPU-s against 21.4 CPU-s with a cold interpreter per attempt). A torchrun
    spare is a new interpreter per attempt (~3 CPU-s each on 2 cores): tests marked
    ``torchrun`` run with ``CFRUN_STANDBY=0`` unless also marked ``spares``. The cold path
    (``CFRUN_STANDBY=0``) is tested where it is the subject (test_standby.py) and by
    ``TESTS_SPARES=0``, which gives no test spares (``TESTS_SPARES=1``: every test)."""
    marked = request.node.get_closest_marker("spares") is not None
    torchrun = request.node.get_closest_marker("torchrun") is not None \
        or os.environ.get("TESTS_LAUNCHER") == "torchrun"
    choice = os.environ.get("TESTS_SPARES")
    SPARES["on"] = choice == "1" or choice != "0" and (marked or not torchrun)
    yield
    SPARES["on"] = choice != "0"


ONE_RANK_LAUNCHER = {"launcher": "python"}
"""The launcher :func:`run_cfrun` gives a one-process job: ``python`` (``CFRUN_LAUNCHER``),
unless the test is marked ``launched`` (``default``: none given, as users launch) or
``torchrun`` (then ``torchrun``, for any number of ranks) (:func:`_one_rank_launcher`). Other
jobs of several ranks on one node run the default (``local``)."""

_SEVERAL_RANK_FLAGS = ("--nproc", "--nnodes", "--launcher", "--standalone", "--rdzv", "--node",
                       "--master")


@pytest.fixture(autouse=True)
def _one_rank_launcher(request: pytest.FixtureRequest) -> Iterator[None]:
    """Where torchrun is not the point, a one-process job runs as ``python SCRIPT``
    (``--launcher python``, a supported mode that checkpoints, supervises and resumes the same
    way, and that the one-rank scripts' plain ``python`` references run as): it saves each
    attempt torchrun's interpreter importing torch (about 3 CPU-seconds and torchrun's
    rendezvous), the largest fixed cost of the suite's ~1,000 launches (issue 27, item 9).
    Tests and modules marked ``launched`` run the default launcher, as users launch (one node:
    cfrun's own, ``local``; several: torchrun): the launch and supervision paths,
    transparency, signals, the README's commands. Tests marked ``torchrun`` run under
    torchrun (``CFRUN_LAUNCHER=torchrun``, one rank or several): its logs, its warm spare, its
    ``--module``. ``TESTS_LAUNCHER=torchrun`` runs every test under torchrun."""
    marked = request.node.get_closest_marker("torchrun") is not None
    everywhere = os.environ.get("TESTS_LAUNCHER") == "torchrun"
    launched = request.node.get_closest_marker("launched") is not None
    ONE_RANK_LAUNCHER["launcher"] = "torchrun" if marked or everywhere else \
        "default" if launched else "python"
    yield
    ONE_RANK_LAUNCHER["launcher"] = "python"


def _launch_env(args: list[str], env: dict[str, str] | None) -> dict[str, str] | None:
    """``env`` with ``CFRUN_LAUNCHER`` added (see :data:`ONE_RANK_LAUNCHER`): ``python`` for a
    one-process launch, ``torchrun`` for any launch of a test marked ``torchrun``; unchanged
    for subcommands other than ``verify`` and ``profile``, for a ``--launcher`` flag (and,
    for ``python``, any rank flag), and where ``env`` chose already."""
    if not args or env and "CFRUN_LAUNCHER" in env or any(
            a.startswith("--launcher") for a in args):
        return env
    if not args[0].startswith("-") and args[0] not in ("verify", "profile") \
            and not args[0].endswith(".py"):
        return env  # resume, status, export, ...: the job's own ranks decide
    if ONE_RANK_LAUNCHER["launcher"] == "torchrun":
        return {**(env or {}), "CFRUN_LAUNCHER": "torchrun"}
    if ONE_RANK_LAUNCHER["launcher"] == "default":
        return env
    if any(a.startswith(_SEVERAL_RANK_FLAGS) for a in args):
        return env
    if env and any(k in env for k in ("CFRUN_NPROC_PER_NODE", "CFRUN_NNODES")):
        return env
    return {**(env or {}), "CFRUN_LAUNCHER": "python"}


def run_cfrun(args: list[str], *, cwd: Path, env: dict[str, str] | None = None,
              timeout: float = 240) -> Run:
    """``python -m cfrun ARGS`` as a real process; returns its exit code and output. A
    one-process job runs with ``--launcher python`` unless the test is marked ``torchrun``
    (:func:`_one_rank_launcher`)."""
    p = subprocess.run([sys.executable, "-m", "cfrun", *args], cwd=cwd,
                       env=clean_env(_launch_env(args, env)), capture_output=True, text=True,
                       timeout=timeout)
    job_dir = Path(cwd)
    if "--job-dir" in args:
        job_dir = Path(cwd) / args[args.index("--job-dir") + 1]
    return Run(p.returncode, p.stdout, p.stderr, job_dir)


def plain_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` without cfrun (the transparency baseline), which must succeed.

    torch 2.13 with gloo may abort a rank in C++ teardown after the script ended (README,
    "Several ranks and nodes", Limits): the run is complete if it printed its last line."""
    p = subprocess.run([sys.executable, *args], cwd=cwd, env=clean_env(), capture_output=True,
                       text=True, timeout=400)
    torn_down = "terminate called without an active exception" in p.stderr \
        and "FINAL" in p.stdout
    assert p.returncode == 0 or torn_down, p.stderr[-3000:]
    return p


def run_on_a_terminal(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> bytes:
    """Run ``argv`` with a pseudo-terminal as its stdin, stdout and stderr (``pty.fork``),
    until it exits; everything it wrote to the terminal."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: nothing but exec (or exit) from here
        if cwd is not None:
            os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    os.close(fd)
    return out


def assert_bit_identical(a: object, b: object, path: str = "") -> None:
    """Nested dicts/lists of tensors and scalars are equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        raw_a = a.reshape(-1).contiguous().view(torch.uint8)
        raw_b = b.reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(raw_a, raw_b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            assert_bit_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def signed_manifest(step_dir: Path, manifest: Any) -> bytes:
    """The bytes of ``manifest`` (a :class:`cfrun.contract.manifest.Manifest`) as the job's
    agent writes them into ``step_dir``: with the MAC under the job dir's ``job.key`` when it
    has one (issue 32). What a test that crafts a checkpoint *of the job* writes; a forger
    without the key cannot."""
    from cfrun.contract.jobkey import JOB_KEY_FILE, read_key_file
    from cfrun.contract.manifest import ManifestKeys

    key_path = step_dir.parent.parent / JOB_KEY_FILE
    if key_path.exists():
        manifest = manifest.signed(ManifestKeys.of_job_key(read_key_file(key_path)).sign)
    return bytes(manifest.dumps())


def resumable_steps(checkpoints: Path) -> list[int]:
    """Committed steps a resume may start from, newest first: all but the final checkpoint
    taken at the script's end (issue 27, item 2), which a resume never starts from."""
    from cfrun.contract.checkpoints import committed_steps, is_final
    from cfrun.contract.jobdir import step_dir_name

    return [s for s in committed_steps(checkpoints)
            if not is_final(checkpoints / step_dir_name(s))]


def final_line(stdout: str) -> str:
    lines = [l for l in stdout.splitlines() if l.startswith("FINAL") or l.startswith("final")]
    assert lines, stdout
    return lines[-1]


def job_events(job: Path, kind: str | None = None) -> list[dict]:
    """The events of job dir ``job`` (``kind``'s only when given); [] before the file exists."""
    return Run(0, "", "", job).events(kind)


def rank_pids(job: Path, attempt: int | None = None) -> list[int]:
    """The pids of an attempt's own processes by local rank (the newest attempt's by default),
    from its ``attempt_pids`` event; [] before it is logged. cfrun's one-node ranks start as
    warm spares, whose command line and environment (``/proc``) are the spare's, not the
    script's: find them here, not by ``cmdline()`` or ``environ()``."""
    logged = [e for e in job_events(job, "attempt_pids")
              if attempt is None or e["attempt"] == attempt]
    return list(logged[-1]["pids"]) if logged else []


ARGPARSE_SCRIPT = """\
import argparse
import torch
p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=1)
p.add_argument("--lr", type=float, default=0.1)
a = p.parse_args()
torch.manual_seed(0)
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), lr=a.lr)
for i in range(10 * a.epochs):
    opt.zero_grad()
    m(torch.randn(8, 4)).sum().backward()
    opt.step()
print("FINAL")
"""
"""A small script with two argparse options (``--epochs``, ``--lr``), ten steps an epoch: the
job-list and small-friction tests write it as their ``train.py``."""


def restarted_attempts(run: Run, rank: int = 0) -> list[tuple[int, int]]:
    """``(resumed, newest)`` for each attempt after the first, in events.jsonl's order: the
    step rank ``rank``'s ``resumed`` event names (0 when the attempt started from scratch,
    with nothing committed to resume) and the newest training step committed before that
    event, as the file logs them (0 when none). A right resume has ``resumed == newest``: a
    kill loses the steps after the newest *committed* checkpoint, which is older than the
    newest taken one while its persist is still under way or when deferral moved it (a slow
    or busy machine; issue 36), so tests assert this property, not where a step landed."""
    finals = run.final_steps()
    commits: list[int] = []
    out: list[list[int]] = []
    for e in run.events():
        if e["event"] == "commit" and e["step"] not in finals:
            commits.append(e["step"])
        elif e["event"] == "attempt_start" and e.get("attempt", 0) > 0:
            out.append([0, max(commits, default=0)])
        elif e["event"] == "resumed" and e.get("rank", 0) == rank and out:
            out[-1] = [e["step"], max(commits, default=0)]
    return [(r, n) for r, n in out]


def assert_resumed_from_newest(run: Run, restarts: int, rank: int = 0) -> list[int]:
    """Asserts ``restarts`` restarted attempts, each resumed from the newest step committed
    before it (:func:`restarted_attempts`); returns their resume steps (0: from scratch)."""
    attempts = restarted_attempts(run, rank)
    assert len(attempts) == restarts, (attempts, run.stderr[-3000:])
    assert all(r == n for r, n in attempts), attempts
    return [r for r, _ in attempts]


def over_recompute_bound(run: Run, kills: list[int], resumed: list[int], k: int
                         ) -> list[tuple[int, int]]:
    """The ``(kill, resumed)`` pairs that recomputed more than K+1 iterations for no stated
    reason: a kill at step ``kill`` resumed from ``resumed`` may recompute more only when the
    checkpoint due after ``resumed`` was deferred while ``resumed`` still persisted, as a
    ``checkpoint_deferred`` event says (issue 23: a deferral costs no step, but the
    checkpoint comes later), or when ``resumed`` was the newest step committed before the
    resume (:func:`restarted_attempts`: the checkpoint after it was taken but still persisting
    at the kill, on a slow or busy machine). [] when every kill is within the bound."""
    deferred = run.events("checkpoint_deferred")
    newest = {r for r, n in restarted_attempts(run) if r == n}
    return [(kill, r) for kill, r in zip(kills, resumed)
            if not 0 <= kill - r <= k + 1
            and not (r <= kill and r in newest)
            and not (r <= kill and any(e["in_flight_step"] == r and e["due_step"] <= kill
                                       for e in deferred))]


def epoch_ends_run_again(kills: list[int], resumed: list[int], steps_per_epoch: int,
                         epochs: int) -> int:
    """How many epoch ends (validation, the epoch's line) a run with these kills and resume
    steps runs a second time: an epoch ending after step ``E`` ran before a kill at step ``k``
    when ``E < k``, and runs again when the resume step ``r <= E`` (the checkpoint of the
    epoch's last step is taken before its end; an older one, when the newest was not yet
    committed at the kill, recomputes the end too)."""
    ends = [steps_per_epoch * (j + 1) for j in range(epochs)]
    return sum(1 for k, r in zip(kills, resumed) for e in ends if r <= e < k)


def slow_but(values: Iterable[Any], *quick: Any) -> list[Any]:
    """``parametrize`` values with every value but ``quick`` marked ``slow``: the quick tier
    runs one case of a parametrized end-to-end test, the slow tier the others (README,
    "Tests"). A tuple value is one case's arguments; ids stay those of the bare values."""
    out = []
    for v in values:
        args = v if isinstance(v, tuple) else (v,)
        out.append(pytest.param(*args, marks=() if v in quick else (pytest.mark.slow,)))
    return out


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path


@contextlib.contextmanager
def mounted_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (``"4m"``) at ``tmp_path/mnt``, mode 0700, unmounted at the
    end. Skips the test, printing why, where mounting is not permitted (CI runs as root)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        reason = f"cannot mount a tmpfs (needs root): {(p.stderr or p.stdout).strip()}"
        print(reason)
        pytest.skip(reason)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ---------------------------------------------------------------------- shared reference runs


def _shared_root(factory: pytest.TempPathFactory) -> Path:
    """A directory every xdist worker of this session sees (the session's own temp dir when
    run without workers)."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/popen-gwK -> pytest-N, shared by this session's workers
    root = base / "shared-runs"
    root.mkdir(exist_ok=True)
    return root


def shared_run(factory: pytest.TempPathFactory, key: str,
               make: Callable[[Path], Run]) -> Run:
    """``make(cwd)`` once per test session, whichever worker and module asks first.

    Uninterrupted reference runs are the same job in several modules (and in several tests of
    one module spread over xdist workers); this runs each once, under a file lock, and hands
    every caller the same :class:`Run`, its job dir and the files it wrote in ``run.cwd``.
    Callers must treat both as read-only (copy a job dir before resuming or damaging it).
    A failing ``make`` is recorded, so every later caller fails at once with its message
    instead of running the job again.
    """
    from filelock import FileLock

    root = _shared_root(factory)
    record = root / f"{key}.json"
    with FileLock(str(root / f"{key}.lock")):
        if not record.exists():
            cwd = root / key
            shutil.rmtree(cwd, ignore_errors=True)
            cwd.mkdir()
            try:
                run = make(cwd)
            except BaseException as e:
                record.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
                raise
            record.write_text(json.dumps({"returncode": run.returncode, "stdout": run.stdout,
                                          "stderr": run.stderr, "job_dir": str(run.job_dir),
                                          "cwd": str(cwd)}))
        data = json.loads(record.read_text())
    if "error" in data:
        pytest.fail(f"shared run {key!r} failed in another test: {data['error']}"[:3000])
    return Run(data["returncode"], data["stdout"], data["stderr"], Path(data["job_dir"]),
               Path(data["cwd"]))


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == 1, run.stderr[-3000:]  # uninterrupted
    return run


def tiny_reference(factory: pytest.TempPathFactory, epochs: int = 4) -> tuple[Run, dict]:
    """train_tiny.py, ``epochs`` epochs (23 steps each), --interval 10, uninterrupted: its Run
    (``ITER_LOG`` at ``run.cwd / "ref.iters"``) and final state (model, optimizer, scheduler)."""
    def make(cwd: Path) -> Run:
        return _ok(run_cfrun(["--interval", "10", "--job-dir", "ref",
                              str(SCRIPTS / "train_tiny.py"), "--epochs", str(epochs), "--out",
                              "ref.pt"], cwd=cwd, env={"ITER_LOG": str(cwd / "ref.iters")}))

    run = shared_run(factory, f"tiny{epochs}", make)
    return run, torch.load(run.cwd / "ref.pt", weights_only=True)


def ddp_reference(factory: pytest.TempPathFactory) -> tuple[Run, dict]:
    """train_ddp.py on 2 ranks (gloo, DDP, DistributedSampler), --interval 10, --keep 3,
    uninterrupted: its Run and rank 0's final model state."""
    def make(cwd: Path) -> Run:
        return _ok(run_cfrun(["--nproc-per-node", "2", "--interval", "10", "--keep", "3",
                              "--job-dir", "ref", str(SCRIPTS / "train_ddp.py"), "ref.pt"],
                             cwd=cwd))

    run = shared_run(factory, "ddp2", make)
    return run, torch.load(run.cwd / "ref.pt", weights_only=True)


def slow_reference(factory: pytest.TempPathFactory) -> tuple[Run, dict]:
    """slow_steps.py, 60 steps without sleeping, --interval 5, uninterrupted: its Run and
    final model + optimizer state (the preemption tests' runs sleep; the state is the same)."""
    def make(cwd: Path) -> Run:
        return _ok(run_cfrun(["--interval", "5", "--job-dir", "ref",
                              str(SCRIPTS / "slow_steps.py"), "60", "ref.pt", "0"], cwd=cwd))

    run = shared_run(factory, "slow60", make)
    return run, torch.load(run.cwd / "ref.pt", weights_only=True)


# ---------------------------------------------------------------------- the CLI in-process


def cfrun_in_process(args: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> Run:
    """``cfrun ARGS`` run by the console script's entry point (``cfrun.cli.app.main``) inside
    this process, through typer's ``CliRunner`` isolation (its own stdout, stderr and
    environment; ``CFRUN_*`` cleared as for :func:`run_cfrun`), in ``cwd``.

    For what the command line decides before it starts any process: parsing, bad input, exit
    codes. Anything that would launch a job must use :func:`run_cfrun` instead.
    """
    import logging

    from typer.testing import CliRunner

    from cfrun.cli.app import main

    logger = logging.getLogger("cfrun")  # main() gives it a handler and stops propagation
    saved = (list(logger.handlers), logger.level, logger.propagate)
    overrides: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CFRUN_")}
    overrides.update(env or {})
    old_cwd = os.getcwd()
    code = 0
    with CliRunner().isolation(env=overrides) as (out, err, _):
        os.chdir(cwd)
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            os.chdir(old_cwd)
            logger.handlers[:], logger.propagate = saved[0], saved[2]
            logger.setLevel(saved[1])
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    job_dir = Path(cwd) / args[args.index("--job-dir") + 1] if "--job-dir" in args else Path(cwd)
    return Run(code, stdout, stderr, job_dir)


# ---------------------------------------------------------------------- parallel runs (xdist)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject addopts): two workers per core. Most of a test's time is spent
    waiting for real processes (sleeping steps, persists, restarts), so a second worker per
    core keeps the cores busy. ``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` (xdist's own variable) or
    ``-n N`` overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return 2 * len(os.sched_getaffinity(0))


# Files whose tests run the longest jobs (two nodes, peers, restarts with sleeping steps; in the
# slow tier the frameworks and FSDP2; in the extended tier the benches and the README demo), and
# the xdist groups whose tests run one after another on one worker (good_checkpoints: ~6 minutes
# of the slow tier's), started first so that no long test is the run's tail (measured on 2
# cores: CI's slowest 30 of stop 41).
LONG_FILES_FIRST = ["test_multinode.py", "test_no_replay.py", "test_fsdp2.py",
                    "test_bench_scaling.py", "test_frameworks.py", "test_bench_gpu_overhead.py",
                    "test_peer.py", "test_readme.py", "test_deterministic_failures.py",
                    "test_transparency.py", "test_reshard.py", "test_bench_gpu_shaped.py",
                    "test_supervision.py", "test_crash_resume.py", "test_policy_runs.py",
                    "test_two_phase.py", "test_good_checkpoints.py", "test_manifest_mac.py",
                    "test_step_loops.py"]


@pytest.hookimpl(tryfirst=True)  # before xdist's, which names each test's group from its marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the run for xdist: tests marked ``timing`` (they assert a wall-clock bound) go into
    one xdist group, so no two of them run at once, and to the front, so that group is not the
    run's tail; then the files of LONG_FILES_FIRST; then the other tests of real processes; the
    quick unit tests last, to fill the gaps at the end. It runs before xdist's own hook, which
    reads the ``xdist_group`` marks: after it, the ``timing`` tests ran as groups of one each,
    on every worker at once."""
    for item in items:
        if item.get_closest_marker("timing"):
            item.add_marker(pytest.mark.xdist_group("timing"))

    def rank(item: pytest.Item) -> tuple[int, int]:
        if item.get_closest_marker("timing"):
            return (0, 0)
        name = Path(str(item.fspath)).name
        if name in LONG_FILES_FIRST:
            return (1, LONG_FILES_FIRST.index(name))
        return (3, 0) if "unit" in Path(str(item.fspath)).parts else (2, 0)

    items.sort(key=rank)  # stable: collection order within each rank
    _leave_the_extended_tier_out(config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Count the ``timing`` tests this session runs (:data:`_TIMING`), once ``-m`` and ``-k``
    have deselected theirs: this file's ``pytest_collection_modifyitems`` runs before pytest's
    own, and a count of the quick tier's timing tests in a slow-tier run never reached 0."""
    _TIMING["total"] = sum(1 for item in session.items if item.get_closest_marker("timing"))
    _TIMING["base_nice"] = os.nice(0)


def _leave_the_extended_tier_out(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``extended`` belongs to the extended tier whatever tier its module or its
    function names besides (a case of a ``slow`` module or parametrization): it runs only when
    ``-m`` names ``extended`` (``-m extended``, ``-m 'slow or extended'``) or is empty
    (``-m ''``: every tier). So ``-m slow``, CI's slow tier, leaves it out."""
    markexpr = config.getoption("markexpr", "") or ""
    if not markexpr.strip() or "extended" in markexpr:
        return
    kept, left = [], []
    for item in items:
        (left if item.get_closest_marker("extended") else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


OTHER_TESTS_NICE = 10
_TIMING = {"total": 0, "base_nice": 0, "niced": 0}
"""The session's number of tests marked ``timing`` (every worker collects them all), this
worker's priority before it lowered it, and whether it did."""


def _timing_done_dir(config: pytest.Config) -> Path:
    """The directory where each worker leaves a file for each ``timing`` test it has torn down;
    all workers of the session see it. It lies in the session's temp dir, which pytest removes
    with the older ones (the tmp_path factory's; xdist's ``testrunuid`` names the run where
    there is none)."""
    factory = getattr(config, "_tmp_path_factory", None)
    if isinstance(factory, pytest.TempPathFactory):
        path = _shared_root(factory) / "timing-done"
    else:
        uid = getattr(config, "workerinput", {}).get("testrunuid", "none")
        path = Path(tempfile.gettempdir()) / f"cfrun-tests-{uid}-timing-done"
    path.mkdir(exist_ok=True)
    return path


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, a worker lowers its CPU priority (``nice``, inherited by the processes its
    tests start) at a test not marked ``timing`` while the session's ``timing`` tests have not
    all run. The timing group is the first work sent out, so its tests run at the normal
    priority while the other workers' jobs yield the cores to them: a wall-clock bound then
    measures cfrun, not the other workers. Once the group is done the priority goes back to
    where it was where the worker may raise it (root; elsewhere it stays lowered): niced
    workers beside other work on the machine (two busy loops, docs/tests.md) got a tenth of the
    cores, and a busy-machine run of the slow tier took about two hours."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or item.get_closest_marker("timing"):
        return
    timing_left = _TIMING["total"] > 0 and \
        sum(1 for _ in _timing_done_dir(item.config).iterdir()) < _TIMING["total"]
    if timing_left and os.nice(0) < OTHER_TESTS_NICE:
        os.nice(OTHER_TESTS_NICE - os.nice(0))
        _TIMING["niced"] = 1
    elif not timing_left and _TIMING["niced"]:
        _TIMING["niced"] = 0
        with contextlib.suppress(PermissionError):  # only a privileged worker may raise it
            os.setpriority(os.PRIO_PROCESS, 0, _TIMING["base_nice"])


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Say to the session's workers that a ``timing`` test is done (:func:`pytest_runtest_setup`
    counts them), whichever worker ran it."""
    if item.get_closest_marker("timing") and os.environ.get("PYTEST_XDIST_WORKER"):
        name = hashlib.sha1(item.nodeid.encode()).hexdigest()[:16]
        (_timing_done_dir(item.config) / name).touch()


@pytest.fixture
def one_rank_mesh() -> Iterator[Any]:
    """A 1-rank gloo process group over a HashStore (in this process) and its 1-D device mesh
    named ``dp``: DTensor code in-process (tests/unit/test_dtensor_codec.py,
    test_reshard_units.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()
