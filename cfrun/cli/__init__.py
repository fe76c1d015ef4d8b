"""The ``cfrun`` command: argument parsing, the run/resume/profile front end, inspection commands."""

from cfrun.cli.app import main

__all__ = ["main"]
