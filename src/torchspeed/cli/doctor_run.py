"""Runs `torchspeed doctor` (imported only when it runs): the script run under the doctor's probe for a bounded
number of optimizer steps, its ranked report printed (and written as JSON), `--fix`'s patches measured; the exit
code says how the script ended (doctor.py's docstring)."""

from __future__ import annotations

import os
import tempfile

from rich.console import Console

from torchspeed.cli.doctor import fix_names, split_rest
from torchspeed.cli.main import CLIError
from torchspeed.doctor import DoctorJob, diagnose_many, exit_code, render_report
from torchspeed.doctor._patch_base import libcst_missing
from torchspeed.doctor.fix import fix_script
from torchspeed.doctor.registry import with_fix
from torchspeed.train.loop.progress import status_bar


def _fix(report, args, script_args, console):
    n = sum(1 for f in report.findings if f.patch)
    with status_bar(f"[bold]doctor --fix[/]: measuring {n} patch(es) on {args.script}, "
                    f"{args.fix_rounds} interleaved rounds", console=console) as progress:
        progress.add_task("fix", total=None)
        result = fix_script(report, args=script_args, steps=args.steps, warmup=args.warmup, rounds=args.fix_rounds,
                            time_limit=args.time_limit, apply=args.apply)
    return with_fix(report, result)  # the findings re-ranked by what each patch measured


def run(args) -> int:
    script_args = split_rest(args)
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
        bad = [f for f in fixes if f not in fix_names()]
        if bad:
            raise CLIError(f"unknown fix(es) {', '.join(bad)}; choose from {', '.join(fix_names())}")
    elif args.no_compile:
        fixes = tuple(f for f in fix_names() if f != "compile")
    if args.apply and not args.fix:
        raise CLIError("--apply writes what --fix measured: use --fix --apply")
    if args.fix:
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
