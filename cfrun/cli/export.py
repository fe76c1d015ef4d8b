"""``cfrun export JOB_DIR OUT``: a checkpoint's model weights as a plain torch or safetensors
file, or a torch.distributed.checkpoint directory (:func:`cfrun.cli.inspect.export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cfrun.contract.config import parse_positive_int
from cfrun.contract.errors import BadInputError

HELP = ("Write a checkpoint's model weights as a plain torch or safetensors file, or a "
        "torch.distributed.checkpoint directory.")
"""``cfrun export --help``'s text."""


def export_cmd(
    job_dir: Annotated[str, typer.Argument(metavar="JOB_DIR", help="The job dir.")],
    out: Annotated[str, typer.Argument(
        metavar="OUT", help="Output file (a new directory with --format dcp).")],
    step: Annotated[str | None, typer.Option(
        "--step", metavar="INTEGER", help="Step (default: newest).")] = None,
    fmt: Annotated[str, typer.Option(
        "--format", metavar="[torch|safetensors|dcp]",
        help="torch (torch.save), safetensors, or dcp (a torch.distributed.checkpoint "
             "directory, for DCP and TorchTitan).")] = "torch",
) -> None:
    """Write a checkpoint's model weights as a plain torch or safetensors file."""
    from cfrun.cli import inspect as report

    jd = report.open_job_dir(job_dir)
    step_n = parse_positive_int("--step", step, minimum=0) if step is not None else None
    out_path = Path(out)
    if fmt == "dcp":
        if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
            raise BadInputError(f"output {out!r} exists; --format dcp writes a new directory: "
                                "give a path that does not exist yet")
    elif out_path.is_dir():
        raise BadInputError(f"output {out!r} is a directory; give a file name, e.g. model.pt")
    if not out_path.parent.is_dir():
        raise BadInputError(f"output {out!r}: directory {str(out_path.parent)!r} does not "
                            "exist; create it first, or give a file in an existing directory")
    got_step, n = report.export(jd, out_path, step=step_n, fmt=fmt)
    note = report.export_note(jd, got_step, asked=step_n is not None)
    print(f"exported step {got_step} ({note}): {n} tensors -> {out_path}")
