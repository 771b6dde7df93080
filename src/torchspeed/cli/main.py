"""`torchspeed <command>`: the entry point. Each subcommand module has `register(subparsers)`.

Expected mistakes (bad flags, missing paths, bad data, a feature whose extra is not installed)
end with a one-line message and a non-zero exit code, not a traceback: subcommands raise `CLIError` for them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torchspeed._extras import MissingExtraError

__all__ = ["main", "CLIError", "COMMANDS"]

# Subcommand modules under torchspeed.cli, in help order.
COMMANDS = ("env", "bench", "launch", "doctor", "data", "train", "tune", "predict")


class CLIError(Exception):
    """An expected user mistake: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchspeed", description="Make PyTorch training fast, and prove it.")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")  # "command" is doctor's script
    for name in COMMANDS:
        importlib.import_module(f"torchspeed.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    name = args.subcommand
    try:
        return int(args.func(args) or 0)
    except (CLIError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, MissingExtraError) as e:  # MissingExtraError: the pip install
        print(f"torchspeed {name}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"torchspeed {name}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text


def run(argv: list[str] | None = None) -> None:
    """The `torchspeed` command and `python -m torchspeed`: `main`, then exit with its status.

    A rank started by `torchspeed launch` that built a process group ends through
    `exit_process`, which skips the interpreter teardown that can abort a finished DDP rank.
    """
    code = main(argv)
    dist = sys.modules.get("torch.distributed")  # never imported: no process group to end
    if dist is not None and dist.is_available() and dist.is_initialized():
        from torchspeed.train.parallel.rank_exit import exit_process

        exit_process(code)
    sys.exit(code)
