"""`torchspeed <command>`: the entry point, and the table of what runs each subcommand.

A subcommand X has two modules: `cli/X.py` builds its parser (`register(subparsers)`: flags, help, defaults; light
imports only) and `cli/X_run.py`, its runner, holds the code that runs it, with its imports at the top. `main` builds
every parser but imports only the runner of the command it parsed (`RUNNERS`), so `torchspeed --help` loads none;
launch, whose runner needs only the standard library, is one module.

Expected mistakes (bad flags, missing paths, bad data, a feature whose extra is not installed)
end with a one-line message and a non-zero exit code, not a traceback: subcommands raise `CLIError` for them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torchspeed._extras import MissingExtraError

__all__ = ["main", "CLIError", "COMMANDS", "RUNNERS"]

# Subcommand modules under torchspeed.cli, in help order: each builds its parser.
COMMANDS = ("env", "bench", "launch", "doctor", "data", "train", "tune", "predict")
# subcommand -> its runner under torchspeed.cli, imported when the subcommand runs. The runner's `run(args)` runs
# it, or the function its parser names in `entry` (`data pack`: run_pack).
RUNNERS = {"env": "env_run", "bench": "bench_run", "launch": "launch", "doctor": "doctor_run", "data": "data_run",
           "train": "train_run", "tune": "tune_run", "predict": "predict_run"}


class CLIError(Exception):
    """An expected user mistake: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `torchspeed` parser, and each subcommand's own parser by name."""
    parser = argparse.ArgumentParser(prog="torchspeed", description="Make PyTorch training fast, and prove it.")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND")  # "command" is doctor's script
    for name in COMMANDS:
        importlib.import_module(f"torchspeed.cli.{name}").register(sub)
    return parser, sub.choices


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parsers()
    args = parser.parse_args(argv)
    name = args.subcommand
    if name is None:
        parser.print_help()
        return 2
    entry = getattr(args, "entry", "run")
    if entry is None:  # a command of commands given none of them (`torchspeed data`): its help
        commands[name].print_help()
        return 2
    try:
        runner = importlib.import_module(f"torchspeed.cli.{RUNNERS[name]}")
        return int(getattr(runner, entry)(args) or 0)
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
