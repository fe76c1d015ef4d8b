"""The ``cfrun`` command: argument parsing, the run/resume/profile front end, inspection."""

from cfrun.cli.app import main

__all__ = ["main"]
