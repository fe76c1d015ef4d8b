"""Where a pytest run's CPU-seconds go: every process it starts, by kind and by test.

The suite is CPU-bound on 2 cores (docs/tests.md), so its wall time is its CPU-seconds over the
cores, and the way to a shorter CI is to know which processes spend them. This runs pytest with
the kernel's process accounting on (``acct(5)``, version 3 records: each process's user and
system time, pid and parent pid, written when it ends, killed or not) and a start log: a ``.pth``
file put in this interpreter's site-packages for the run makes every Python process append its
pid, argv and ``PYTEST_CURRENT_TEST`` (inherited from the pytest worker) to a file. Joined on the
pid, and up the parents for processes that forked without a new interpreter (warm spares, loader
workers), they give each process its kind and its test.

Needs root and ``accton`` (Debian's ``acct`` package); accounting is machine-wide, and this
turns it off at the end. Usage (the measured run of docs/tests.md)::

    .venv/bin/python bench/suite_cpu.py --out /tmp/suite-cpu -- -m slow

Prints the CPU-seconds by kind of process, then the costliest tests; keeps ``pacct`` and
``starts.jsonl`` in ``--out``. Exit codes: 0, 2 (no accton), 3 (not root), else pytest's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

ACCT_V3 = struct.Struct("<ccHIIIIIIfHHHHHHHH16s")  # struct acct_v3, linux/acct.h: 64 bytes
AHZ = 100  # acct_v3 times are in 1/100 s
LOGGER = '''import json, os, sys, time
_path = os.environ.get("SUITE_CPU_LOG")
if _path:
    try:
        with open(_path, "a") as _f:
            _f.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "t": time.time(),
                                 "argv": list(getattr(sys, "orig_argv", []))[:12],
                                 "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\\n")
    except OSError:
        pass
'''


def _comp_t(v: int) -> int:
    """acct's ``comp_t``: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (v & 0x1FFF) << (3 * (v >> 13))


def read_pacct(path: Path) -> list[dict]:
    """Records of an ``acct`` v3 file: pid, ppid, CPU seconds (user + system), command name."""
    data = path.read_bytes()
    out = []
    for off in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        f = ACCT_V3.unpack_from(data, off)
        out.append({"pid": f[6], "ppid": f[7], "cpu_s": (_comp_t(f[10]) + _comp_t(f[11])) / AHZ,
                    "comm": f[18].split(b"\0")[0].decode(errors="replace")})
    return out


def kind_of(argv: list[str]) -> str:
    """What a Python process of the suite is, from its argv."""
    s = " ".join(argv[1:])
    if "exec(eval(" in s:
        return "pytest worker"
    if argv[1:3] == ["-m", "pytest"]:
        return "pytest"
    if argv[1:3] == ["-m", "cfrun"]:
        return "cfrun command"
    if "reaper_main" in s:
        return "reaper"
    if "run_module" in s and len(argv) > 4:
        return {"cfrun.rank.spare": "rank", "cfrun.agent": "persist agent",
                "cfrun.supervisor.torchrun_log": "torchrun under cfrun"}.get(argv[4], argv[4])
    if "torch.distributed.run" in s or "torchrun" in s:
        return "torchrun"
    return "script"


def account(pacct: Path, starts: Path) -> tuple[collections.Counter[str],
                                                 collections.Counter[str], int]:
    """CPU-seconds by kind of process (a script under a ``cfrun`` command is one of its ranks,
    one elsewhere a plain reference run) and by test, and the number of records; processes that
    descend from no logged Python process (not the run's) are left out."""
    log = {}
    for line in starts.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue  # a line cut by a process killed while writing it
        log[d["pid"]] = d
    records = read_pacct(pacct)
    parent = {r["pid"]: r["ppid"] for r in records}
    for d in log.values():
        parent.setdefault(d["pid"], d["ppid"])

    def ancestry(pid: int) -> list[dict]:
        chain = []
        for _ in range(64):
            if pid in log:
                chain.append(log[pid])
            pid = parent.get(pid, 0)
            if not pid:
                break
        return chain

    by_kind: collections.Counter[str] = collections.Counter()
    by_test: collections.Counter[str] = collections.Counter()
    for r in records:
        chain = ancestry(r["pid"])
        if not chain:
            continue  # not started by the run
        kinds = [kind_of(d["argv"]) for d in chain]
        k = kinds[0]
        if r["pid"] not in log:  # forked without a new interpreter
            k = "loader workers" if r["comm"].startswith("pt_data_worker") else \
                "rank" if "cfrun command" in kinds or "rank" in kinds else k
        elif k in ("script", "torchrun"):
            k = ("rank" if k == "script" else "torchrun under cfrun") if "cfrun command" in \
                kinds[1:] else f"plain {k}"
        by_kind[k] += r["cpu_s"]
        by_test[chain[0]["test"].split(" ")[0] or "(no test: pytest itself)"] += r["cpu_s"]
    return by_kind, by_test, len(records)


def report(pacct: Path, starts: Path, top: int) -> str:
    """The tables of :func:`account`: by kind of process, then the ``top`` costliest tests."""
    by_kind, by_test, n = account(pacct, starts)
    total = sum(by_kind.values())
    lines = [f"{total:,.0f} CPU-s in {n:,} processes", "", "CPU-s  share  kind"]
    lines += [f"{v:7.0f} {v / total:5.1%}  {k}" for k, v in by_kind.most_common()]
    lines += ["", f"the {top} costliest tests (CPU-s)"]
    lines += [f"{v:7.1f}  {t}" for t, v in by_test.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for pacct, starts.jsonl")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = ap.parse_args()
    accton = shutil.which("accton")
    if accton is None:
        print("suite_cpu: accton not found: install Debian's acct (apt-get install acct)",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("suite_cpu: process accounting needs root: run it as root", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    pacct, starts = args.out / "pacct", args.out / "starts.jsonl"
    for f in (pacct, starts):
        f.unlink(missing_ok=True)
    pacct.touch()
    site = Path(sysconfig.get_paths()["purelib"])
    hook, pth = site / "_suite_cpu_log.py", site / "_suite_cpu_log.pth"
    hook.write_text(LOGGER)
    pth.write_text("import _suite_cpu_log\n")
    try:
        subprocess.run([accton, str(pacct)], check=True, capture_output=True)
        rc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                             *args.pytest_args], env={**os.environ,
                                                      "SUITE_CPU_LOG": str(starts)}).returncode
    finally:
        subprocess.run([accton, "off"], capture_output=True)
        pth.unlink(missing_ok=True)
        hook.unlink(missing_ok=True)
    print(report(pacct, starts, args.top))
    return rc


if __name__ == "__main__":
    sys.exit(main())
