"""Shared helpers: run cfrun as a real process, compare saved states bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
EXAMPLES = ROOT / "examples"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    job_dir: Path

    def events(self, kind: str | None = None) -> list[dict]:
        import json

        path = self.job_dir / "events.jsonl"
        if not path.exists():
            return []
        out = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
        return [e for e in out if kind is None or e["event"] == kind]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CFRUN_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def run_cfrun(args: list[str], *, cwd: Path, env: dict[str, str] | None = None,
              timeout: float = 240) -> Run:
    """``python -m cfrun ARGS`` as a real process; returns its exit code and output."""
    p = subprocess.run([sys.executable, "-m", "cfrun", *args], cwd=cwd, env=clean_env(env),
                       capture_output=True, text=True, timeout=timeout)
    job_dir = Path(cwd)
    if "--job-dir" in args:
        job_dir = Path(cwd) / args[args.index("--job-dir") + 1]
    return Run(p.returncode, p.stdout, p.stderr, job_dir)


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


def final_line(stdout: str) -> str:
    lines = [l for l in stdout.splitlines() if l.startswith("FINAL") or l.startswith("final")]
    assert lines, stdout
    return lines[-1]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    return tmp_path
