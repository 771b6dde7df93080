"""`torchspeed <command>`: the entry point. Each subcommand module has `register(subparsers)`.

Expected mistakes (bad flags, missing paths, bad data) end with a one-line message and a
non-zero exit code, not a traceback: subcommands raise `CLIError` for them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "CLIError", "COMMANDS"]

# Subcommand modules under torchspeed.cli, in help order.
COMMANDS = ("env", "bench", "launch", "doctor", "data", "train", "tune")


class CLIError(Exception):
    """An expected user mistake: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchspeed", description="Make PyTorch training fast, and prove it.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"torchspeed.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"torchspeed {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        print(f"torchspeed {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"torchspeed {args.command}: interrupted", file=sys.stderr)
        return 130
