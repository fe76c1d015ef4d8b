"""The ``cfrun`` console script and ``python -m cfrun``: hold SIGTERM/SIGINT/SIGHUP
(:mod:`cfrun.contract.early_signals`) before the heavy imports, then run the CLI."""

from cfrun.contract import early_signals


def main() -> None:
    """Entry point; exits the process with cfrun's exit code (:func:`cfrun.cli.app.main`)."""
    early_signals.hold()
    from cfrun.cli.app import main as cli_main

    cli_main()
