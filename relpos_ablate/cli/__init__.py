"""`relpos-ablate` command line: argument parsing only; each command lives in its own module.

Commands register themselves through `register(subparsers)` in the modules listed in
COMMAND_MODULES. A bad config or argument prints one line per problem (`error: <key>: <what is
allowed>`) and exits with status 2.

The command modules import what a command needs (torch, pandas, the runner) inside the function
that runs it, not at the top: `--help`, `status` and the rerun of a finished grid start in a
fraction of a second and never load torch (tests/runner/test_runner_local.py checks the rerun).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from relpos_ablate import __version__
from relpos_ablate.config import ConfigError

COMMAND_MODULES = (
    "relpos_ablate.cli.train",
    "relpos_ablate.cli.grid",
    "relpos_ablate.cli.report",
    "relpos_ablate.cli.plot",
    "relpos_ablate.cli.evaluate",
)


class UsageError(Exception):
    """A user mistake the CLI reports in one line (exit status 2)."""


def check_dir_arg(flag: str, path: Path) -> None:
    """A directory argument (created when missing) must not be a file nor lie under one: caught
    here, it is one line; later, a NotADirectoryError traceback."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        raise UsageError(f"{flag}: {path} {where}; give a directory (created when missing)")


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors in the CLI's one-line form (argparse prints the whole usage block first);
    subcommand parsers inherit it."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="relpos-ablate",
        description="Ablate relative position encodings: train runs, sweep grids, tabulate and "
        "plot results.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        for problem in err.errors:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
