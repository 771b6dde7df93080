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
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchspeed.doctor._envfix import measure_env_fixes
from torchspeed.doctor._fit_plan import beyond_grid
from torchspeed.doctor._interval import SEED
from torchspeed.doctor._job import run_job
from torchspeed.doctor._script_options import with_script_options
from torchspeed.doctor.observation import Observation
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
    env: dict | None = None        # variables added to this run's environment (it then runs in its own process)
    env_rounds: int = 5            # environment fixes: interleaved re-runs of the script with each (0: none)
    env_steps: int = 6             # measured steps per environment re-run

    def to_spec(self) -> dict:
        return {"script": os.path.abspath(self.script), "args": list(self.args), "steps": self.steps,
                "warmup": self.warmup, "verify": self.verify, "fixes": list(self.fixes) if self.fixes else None,
                "rounds": self.rounds, "time_limit": self.time_limit, "source": self.source,
                "measure_only": self.measure_only}


def report_from_observation(obs: Observation, *, script: str | None = None) -> DoctorReport:
    """Apply every registered rule to one observation; where an option of the script (`--amp`, `--workers`)
    already gives a finding's fix, that option comes first in it (`_script_options`)."""
    findings = tuple(run_rules(obs)) if obs.get("status") not in ("doctor-error", "killed") else ()
    if (obs.get("fit_plan") or {}).get("chosen"):  # what fit does beyond the plan's grid, from what was measured
        obs["fit_plan"]["beyond_grid"] = beyond_grid(obs)
    path = script or obs.get("script")
    if findings and path and os.path.isfile(path):  # the script's own options that give a fix come first
        with open(path, errors="replace") as f:
            findings = tuple(with_script_options(findings, obs, f.read()))
    return DoctorReport(script=script or obs.get("script", "?"), status=obs.get("status", "?"),
                        traceback=obs.get("traceback"), env=obs.get("env", {}), breakdown=obs.get("breakdown", {}),
                        findings=findings, verify=obs.get("verify", {}), notes=tuple(obs.get("notes", [])),
                        observation=obs)


def _check_script(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such script: {path}")


def _child_code() -> str:
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # `python train.py` puts only the script's folder first on sys.path (not the current
    # directory): drop the '' that -c adds; run_job inserts the script's folder. -B: no
    # __pycache__ is written into the user's folders.
    return ("import sys\nif sys.path and sys.path[0] == '': sys.path.pop(0)\n"
            f"sys.path.append({src!r})\n"
            "from torchspeed.doctor._child import main\nraise SystemExit(main(sys.argv))")


def _groups(jobs: Sequence[DoctorJob]) -> list[list[int]]:
    """Job indices per child process: consecutive jobs without an environment share one; a job with one
    (`DoctorJob.env`) gets its own, since allocator and OpenMP settings are read when a process starts."""
    out: list[list[int]] = []
    for i, j in enumerate(jobs):
        if j.env is None and out and jobs[out[-1][0]].env is None:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _run_child(jobs: list[DoctorJob], tmp: str, tag: int, *, env: dict | None, quiet: bool, threads: int | None,
               log_path: str | None) -> tuple[dict[int, dict], str | None]:
    """Run `jobs` in one child process; ({index in jobs: observation}, why the rest are missing)."""
    spec_path, out_path = os.path.join(tmp, f"spec{tag}.json"), os.path.join(tmp, f"out{tag}.jsonl")
    with open(spec_path, "w") as f:
        json.dump({"jobs": [j.to_spec() for j in jobs], "threads": threads}, f)
    budget = sum(j.time_limit + (120.0 if j.verify else 0.0) + 30.0 for j in jobs) + 60.0
    out_stream = None
    if quiet:
        out_stream = open(log_path, "a") if log_path else subprocess.DEVNULL
    child_env = {**os.environ, **{k: str(v) for k, v in env.items()}} if env else None
    proc = subprocess.Popen([sys.executable, "-B", "-c", _child_code(), spec_path, out_path],
                            stdout=out_stream, stderr=out_stream, env=child_env)
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
    why = "killed after the time limit" if killed else f"the doctor's process ended with code {proc.returncode}"
    return results, why


def diagnose_many(jobs: Sequence[DoctorJob], *, quiet: bool = False, threads: int | None = None,
                  log_path: str | None = None, measure_env=None) -> list[DoctorReport]:
    """Run several scripts one after another in one child process (torch is imported once).

    A job with its own environment (`DoctorJob.env`) runs in a process of its own. After a full run
    (not `measure_only`), the environment fixes that apply to the script (`_envfix`) are measured by
    re-running a few of its steps with each, interleaved with the original, unless `env_rounds` is 0;
    `measure_env(job, candidates)` replaces that re-run (tests inject measured ratios through it)."""
    for j in jobs:
        _check_script(j.script)
    if log_path:
        open(log_path, "w").close()
    results: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="torchspeed-doctor-") as tmp:
        for tag, group in enumerate(_groups(jobs)):
            got, why = _run_child([jobs[i] for i in group], tmp, tag, env=jobs[group[0]].env, quiet=quiet,
                                  threads=threads, log_path=log_path)
            for k, i in enumerate(group):
                results[i] = got.get(k) or {"script": jobs[i].script, "status": "killed", "traceback": None,
                                            "notes": [why], "env": {}}
    reports = []
    for i, j in enumerate(jobs):
        obs = results[i]
        if not j.measure_only and j.env_rounds > 0 and obs.get("status") in ("stopped", "finished"):
            measure_env_fixes(j, obs, measure=measure_env, run_variants=measure_variants)
        reports.append(report_from_observation(obs, script=j.script))
    return reports


def diagnose(script: str, *, args: Sequence[str] = (), steps: int = 30, warmup: int = 5, verify: bool = False,
             fixes: Sequence[str] | None = None, rounds: int = 5, time_limit: float = 300.0,
             quiet: bool = False, isolate: bool = True, env_rounds: int = 5, measure_env=None) -> DoctorReport:
    """Diagnose one training script; see the module docstring.

    `isolate=False` runs the script in this process (faster to start; every patch is
    undone afterwards, but a script that hangs in C code cannot be stopped there; the environment
    fixes are not measured there). `env_rounds`, `measure_env`: see `diagnose_many`.
    """
    job = DoctorJob(script=script, args=tuple(args), steps=steps, warmup=warmup, verify=verify,
                    fixes=tuple(fixes) if fixes else None, rounds=rounds, time_limit=time_limit,
                    env_rounds=env_rounds)
    if not isolate:
        _check_script(script)
        return report_from_observation(run_job(job.to_spec()), script=script)
    return diagnose_many([job], quiet=quiet, measure_env=measure_env)[0]


def _step_ms(r: DoctorReport) -> float | None:
    ms = r.breakdown.get("step_ms") if r.status in ("stopped", "finished") else None
    return ms if ms else None


def measure_variants(script: str, args: Sequence[str], sources: list[str | None], *, steps: int, warmup: int,
                     rounds: int, time_limit: float, threads: int | None, envs: list[dict | None] | None = None) -> list[dict]:
    """Interleaved runs: per round the original (the first variant) and each other one, in an order drawn at
    random per round; per variant the ratios (original step ms / variant step ms). A variant is a source (None: the script's own text) and,
    with `envs`, an environment: a variant with one runs in its own process with those variables added."""
    envs = envs or [None] * len(sources)
    n = len(sources)
    rng = random.Random(SEED)  # each round's order drawn at random (seeded): no variant always runs first
    orders = [rng.sample(range(n), n) for _ in range(rounds)]
    jobs = [DoctorJob(script=script, args=tuple(args), steps=steps, warmup=warmup, time_limit=time_limit,
                      source=sources[i], env=envs[i], measure_only=True) for order in orders for i in order]
    ran = diagnose_many(jobs, quiet=True, threads=threads)
    reports = [None] * len(ran)
    for r_i, order in enumerate(orders):  # back in the variants' own order, round by round
        for pos, i in enumerate(order):
            reports[r_i * n + i] = ran[r_i * n + pos]
    out = [{"ratios": [], "ms": [], "error": None} for _ in sources]
    for r_i in range(rounds):
        row = reports[r_i * n:(r_i + 1) * n]
        base = _step_ms(row[0])
        for i, r in enumerate(row):
            ms = _step_ms(r)
            if ms is None:
                out[i]["error"] = (r.traceback or f"status {r.status}").strip().splitlines()[-1]
                continue
            out[i]["ms"].append(round(ms, 3))
            if base:
                out[i]["ratios"].append(round(base / ms, 4))
    for m in out:
        m["speedup"] = round(statistics.median(m["ratios"]), 4) if m["ratios"] and not m["error"] else None
    return out
