"""`torchspeed doctor train.py [-- script args] [--steps N] [--json PATH] [--verify] [--fix [--apply]]` (T02, T03).

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
import os
import tempfile

from torchspeed.cli.main import CLIError

def _fix_names() -> tuple[str, ...]:
    """The fixes the rules declare (`register(..., fix=)`): the one table of fix names."""
    from torchspeed.doctor.registry import fix_rules

    return tuple(fix_rules())


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=30, help="optimizer steps to measure after warm-up (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps not measured (default 5)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    p.add_argument("--verify", action="store_true",
                   help="measure each applicable fix on the script's model (interleaved with the baseline)")
    p.add_argument("--fixes", default=None,
                   help=f"comma-separated fixes for --verify (default: all that apply): {','.join(_fix_names())}")
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


def _split_rest(args) -> list[str]:
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


def _fix(report, args, script_args, console):
    import dataclasses

    from torchspeed.doctor.fix import fix_script
    from torchspeed.train.loop.progress import status_bar

    n = sum(1 for f in report.findings if f.patch)
    with status_bar(f"[bold]doctor --fix[/]: measuring {n} patch(es) on {args.script}, "
                    f"{args.fix_rounds} interleaved rounds", console=console) as progress:
        progress.add_task("fix", total=None)
        result = fix_script(report, args=script_args, steps=args.steps, warmup=args.warmup, rounds=args.fix_rounds,
                            time_limit=args.time_limit, apply=args.apply)
    from torchspeed.doctor.registry import with_fix

    return with_fix(report, result)  # the findings re-ranked by what each patch measured


def run(args) -> int:
    from rich.console import Console
    from torchspeed.doctor import DoctorJob, diagnose_many, exit_code, render_report
    from torchspeed.train.loop.progress import status_bar

    script_args = _split_rest(args)
    if not os.path.isfile(args.script):
        raise CLIError(f"no such script: {args.script}")
    if not args.script.endswith(".py"):
        raise CLIError(f"{args.script} is not a Python file; give the training script, e.g. train.py")
    if args.rounds < 2:
        raise CLIError(f"--rounds must be at least 2 (an interval needs rounds on each side), got {args.rounds}")
    if args.steps < 1 or args.warmup < 1:
        raise CLIError("--steps and --warmup must be at least 1 (the first step always includes start-up)")
    fixes = None
    if args.fixes:
        fixes = tuple(f.strip() for f in args.fixes.split(",") if f.strip())
        bad = [f for f in fixes if f not in _fix_names()]
        if bad:
            raise CLIError(f"unknown fix(es) {', '.join(bad)}; choose from {', '.join(_fix_names())}")
    elif args.no_compile:
        fixes = tuple(f for f in _fix_names() if f != "compile")
    if args.apply and not args.fix:
        raise CLIError("--apply writes what --fix measured: use --fix --apply")
    if args.fix:
        from torchspeed.doctor._patch_base import libcst_missing

        hint = libcst_missing()
        if hint:
            raise CLIError(hint)
        if args.fix_rounds < 1:
            raise CLIError("--fix-rounds must be at least 1")
    job = DoctorJob(script=args.script, args=tuple(script_args), steps=args.steps, warmup=args.warmup,
                    verify=args.verify, fixes=fixes, rounds=args.rounds, time_limit=args.time_limit,
                    env_rounds=args.rounds)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="torchspeed-doctor-") as tmp:
        log = os.path.join(tmp, "script-output.txt")
        if args.show_output:
            report = diagnose_many([job], quiet=False)[0]
        else:
            what = "running the script" + (" and measuring each fix" if args.verify else "")
            with status_bar(f"[bold]doctor[/]: {what} ({args.script})", console=console) as progress:
                progress.add_task("run", total=None)
                report = diagnose_many([job], quiet=True, log_path=log)[0]
        tail = ""
        if report.status in ("raised", "exited", "killed") and os.path.exists(log):
            with open(log, errors="replace") as f:
                tail = "".join(f.readlines()[-15:])
    if args.fix and report.status in ("stopped", "finished"):
        report = _fix(report, args, script_args, console)
    render_report(report, console)
    if tail:
        console.print("[dim]last lines the script printed:[/]")
        console.print(tail, markup=False, highlight=False)
    if args.json:
        report.write_json(args.json)
        console.print(f"report written to {args.json}")
    return exit_code(report, fail_on_regression=args.fail_on_regression)
