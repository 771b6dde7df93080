"""`torchspeed doctor train.py [-- script args] [--steps N] [--json PATH] [--verify] [--fix [--apply]]`'s parser,
and the split of the doctor's options from the script's arguments (T02, T03; run by doctor_run.py).

`--fix` writes each applicable finding as a patch of the script and measures it on the script
itself (see `torchspeed.doctor.fix`); `--fix --apply` also writes the kept patches into the file.

Runs an unmodified training script under the doctor's probe (see `torchspeed.doctor`), for
a bounded number of optimizer steps, and prints the ranked report. The script's own output
goes to a log file unless `--show-output` is given. Exit code: 0 when the script was
diagnosed, 1 when it raised, exited with an error or had to be killed (the report is still
printed, with its traceback), 2 for a usage mistake, 3 with `--fail-on-regression` when the
verdict (`report.report_verdict`, also in `--json` under "verdict") is "regression".
"""

from __future__ import annotations

import argparse

from torchspeed.cli.main import CLIError
from torchspeed.doctor.registry import fix_rules


def fix_names() -> tuple[str, ...]:
    """The fixes the rules declare (`register(..., fix=)`): the one table of fix names."""
    return tuple(fix_rules())


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=30, help="optimizer steps to measure after warm-up (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps not measured (default 5)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    p.add_argument("--verify", action="store_true",
                   help="measure each applicable fix on the script's model (interleaved with the baseline)")
    p.add_argument("--fixes", default=None,
                   help=f"comma-separated fixes for --verify (default: all that apply): {','.join(fix_names())}")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile in --verify (it takes a while)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds a side per measured fix, --verify's and the environment re-runs' "
                        "(default 5; --verify adds rounds while an interval is too wide to rank)")
    p.add_argument("--time-limit", type=float, default=300.0, help="stop the script after this many seconds (default 300)")
    p.add_argument("--show-output", action="store_true", help="let the script print to this terminal")
    p.add_argument("--fix", action="store_true",
                   help="write each applicable finding as a patch of the script and measure it on the script itself, "
                        "interleaved with the original (needs libcst)")
    p.add_argument("--apply", action="store_true", help="with --fix: write the patches that measured faster into the "
                                                        "script (otherwise the user's files are never written)")
    p.add_argument("--fail-on-regression", action="store_true",
                   help="exit with code 3 when the verdict is 'regression': a measured fix whose 95%% interval's "
                        "lower bound clears the medium threshold (1.05x), i.e. the script runs measurably slower "
                        "than it would with that fix (for CI)")
    p.add_argument("--fix-rounds", type=int, default=3, help="interleaved runs of the original and each patched "
                                                             "script in --fix (default 3)")


def register(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose a training script: where step time goes, ranked fixes, measured",
                       description="Run train.py as `python train.py ARGS` would, under instrumentation, for a "
                                   "bounded number of optimizer steps; report and rank what slows it down. "
                                   "Script arguments go after `--`.")
    _add_options(p)
    # one REMAINDER positional keeps the `--` that separates the script's own arguments
    # (argparse drops it between two positionals)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="train.py [options] [-- script args]",
                   help="the training script (it is run, never modified), then its arguments after `--`")


def split_rest(args) -> list[str]:
    """Doctor options may follow the script; everything after `--` belongs to the script."""
    command = list(args.command or [])
    if not command or command[0] == "--":
        raise CLIError("give the training script: torchspeed doctor train.py [-- script args]")
    args.script, rest = command[0], command[1:]
    if "--" in rest:
        i = rest.index("--")
        head, tail = rest[:i], rest[i + 1:]
    else:
        head, tail = rest, []
    if head:
        opts = argparse.ArgumentParser(prog="torchspeed doctor", add_help=False)
        _add_options(opts)
        try:
            parsed, unknown = opts.parse_known_args(head, namespace=args)
        except SystemExit:
            raise CLIError(f"could not parse doctor options {' '.join(head)!r}") from None
        if unknown:
            raise CLIError(f"unknown option(s) {' '.join(unknown)}; pass the script's own arguments after `--`, "
                           f"e.g. torchspeed doctor {args.script} -- {' '.join(unknown)}")
    return tail
