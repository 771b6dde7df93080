"""`diagnose`: run a training script under the probe, apply the rules, return a ranked report (T02, T03).

The script runs in a child process (`python -m torchspeed.doctor._child`), exactly as
`python train.py args` would run it, so a hung or crashing script can always be killed and
the calling process stays clean; the child writes its observations as JSON. The user's
files are never written.

Example:
    >>> report = diagnose("train.py", args=["--epochs", "1"], steps=30, verify=True)
    >>> [(f.rule, f.severity) for f in report.findings]
    [('data-bound', 'high'), ('dataloader-workers', 'high'), ('no-amp', 'low')]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchspeed.doctor.registry import run_rules
from torchspeed.doctor.report import DoctorReport

__all__ = ["DoctorJob", "diagnose", "diagnose_many", "report_from_observation"]


@dataclass(frozen=True)
class DoctorJob:
    """One script to diagnose and how."""

    script: str
    args: tuple[str, ...] = ()
    steps: int = 30
    warmup: int = 5
    verify: bool = False
    fixes: tuple[str, ...] | None = None
    rounds: int = 5
    time_limit: float = 300.0
    extra: dict = field(default_factory=dict)
    source: str | None = None      # run this text as the script (a --fix candidate), the file is not read
    measure_only: bool = False     # the step-time breakdown only (no model checks, no profiling)

    def to_spec(self) -> dict:
        return {"script": os.path.abspath(self.script), "args": list(self.args), "steps": self.steps,
                "warmup": self.warmup, "verify": self.verify, "fixes": list(self.fixes) if self.fixes else None,
                "rounds": self.rounds, "time_limit": self.time_limit, "source": self.source,
                "measure_only": self.measure_only}


def report_from_observation(obs: dict, *, script: str | None = None) -> DoctorReport:
    """Apply every registered rule to one observation."""
    findings = tuple(run_rules(obs)) if obs.get("status") not in ("doctor-error", "killed") else ()
    return DoctorReport(script=script or obs.get("script", "?"), status=obs.get("status", "?"),
                        traceback=obs.get("traceback"), env=obs.get("env", {}), breakdown=obs.get("breakdown", {}),
                        findings=findings, verify=obs.get("verify", {}), notes=tuple(obs.get("notes", [])),
                        observation=obs)


def _check_script(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such script: {path}")


def diagnose_many(jobs: Sequence[DoctorJob], *, quiet: bool = False, threads: int | None = None,
                  log_path: str | None = None) -> list[DoctorReport]:
    """Run several scripts one after another in one child process (torch is imported once)."""
    for j in jobs:
        _check_script(j.script)
    with tempfile.TemporaryDirectory(prefix="torchspeed-doctor-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.jsonl")
        with open(spec_path, "w") as f:
            json.dump({"jobs": [j.to_spec() for j in jobs], "threads": threads}, f)
        budget = sum(j.time_limit + (120.0 if j.verify else 0.0) + 30.0 for j in jobs) + 60.0
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # `python train.py` puts only the script's folder first on sys.path (not the current
        # directory): drop the '' that -c adds; run_job inserts the script's folder. -B: no
        # __pycache__ is written into the user's folders.
        code = ("import sys\nif sys.path and sys.path[0] == '': sys.path.pop(0)\n"
                f"sys.path.append({src!r})\n"
                "from torchspeed.doctor._child import main\nraise SystemExit(main(sys.argv))")
        out_stream = None
        if quiet:
            out_stream = open(log_path, "w") if log_path else subprocess.DEVNULL
        proc = subprocess.Popen([sys.executable, "-B", "-c", code, spec_path, out_path],
                                stdout=out_stream, stderr=out_stream)
        killed = False
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            proc.kill()  # the in-process time limit did not get control back: kill the child
            proc.wait()
            killed = True
        finally:
            if quiet and log_path:
                out_stream.close()
        results: dict[int, dict] = {}
        if os.path.exists(out_path):
            with open(out_path) as f:
                for line in f:
                    if line.strip():
                        obs = json.loads(line)
                        results[obs["job"]] = obs
    reports = []
    for i, j in enumerate(jobs):
        obs = results.get(i)
        if obs is None:
            why = "killed after the time limit" if killed else f"the doctor's process ended with code {proc.returncode}"
            obs = {"script": j.script, "status": "killed", "traceback": None, "notes": [why], "env": {}}
        reports.append(report_from_observation(obs, script=j.script))
    return reports


def diagnose(script: str, *, args: Sequence[str] = (), steps: int = 30, warmup: int = 5, verify: bool = False,
             fixes: Sequence[str] | None = None, rounds: int = 5, time_limit: float = 300.0,
             quiet: bool = False, isolate: bool = True) -> DoctorReport:
    """Diagnose one training script; see the module docstring.

    `isolate=False` runs the script in this process (faster to start; every patch is
    undone afterwards, but a script that hangs in C code cannot be stopped there).
    """
    job = DoctorJob(script=script, args=tuple(args), steps=steps, warmup=warmup, verify=verify,
                    fixes=tuple(fixes) if fixes else None, rounds=rounds, time_limit=time_limit)
    if not isolate:
        _check_script(script)
        from torchspeed.doctor._job import run_job
        return report_from_observation(run_job(job.to_spec()), script=script)
    return diagnose_many([job], quiet=quiet)[0]
