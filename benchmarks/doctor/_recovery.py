"""Fault recovery (`bench_doctor.py --recovery`): does the gain the doctor measures for a fault's fix hold
the fault's true cost?

For each fault of the fault gallery (tests/doctor/faults/fault_train.py):
- the true factor: the script with the fault against the same script with the fix made by hand (the clean
  twin, or the doctor's own setting given by hand: `--workers 2`, `OMP_NUM_THREADS=1`, glibc's variables),
  each in a fresh process timing its steps after the first 5 (`--report-ms`), interleaved, `--true-rounds`
  rounds a side, with the 95% bootstrap interval of the ratio of the medians (`torchspeed.doctor._interval`);
- the doctor's verdict, `--repeats` times (each run in its own process, the faults taken in turn so that a
  drift of the machine lands on all of them): the interval of the fix's gain (`--verify`'s, or the
  environment re-run's), and whether it contains the true factor (the goal: 9 runs of 10);
- the clean twin, the same number of times: no finding ranked high or medium (the goal: none).

host_sync has no fix to measure: on a CPU a per-step `.item()` costs next to nothing, and the goal is that
the doctor ranks no host-sync finding high or medium while the true factor stays near 1.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torchspeed.doctor import DoctorJob, diagnose_many
from torchspeed.doctor._interval import bootstrap_interval
from torchspeed.env import GLIBC_MALLOC_ENV

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent.parent / "tests" / "doctor" / "faults" / "fault_train.py"

# fault: (the doctor's fix, where its interval is read, the rule, the fix by hand: (args, env))
CASES = {
    "fp32_conv": ("autocast", "verify", "no-amp", (("--fault", "none"), {})),
    "nchw": ("channels_last", "verify", "channels-last", (("--fault", "none"), {})),
    "sleep_getitem": ("workers", "verify", "dataloader-workers", (("--fault", "sleep_getitem", "--workers", "2"), {})),
    "oversubscribed": ("threads", "env", "cpu-oversubscribed", (("--fault", "oversubscribed"), {"OMP_NUM_THREADS": "1"})),
    "affinity": ("cores", "env", "cpu-threads", (("--fault", "affinity"), {"OMP_NUM_THREADS": "1"})),
    "malloc": ("malloc", "env", "allocator", (("--fault", "malloc"), dict(GLIBC_MALLOC_ENV))),
    "host_sync": (None, None, "host-sync", (("--fault", "none"), {})),
}


def _ms(args, env, steps: int) -> float:
    out = subprocess.run([sys.executable, str(SCRIPT), *args, "--steps", str(steps), "--report-ms"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["ms_per_step"]


def true_factor(fault: str, rounds: int, steps: int) -> dict:
    """The fault's step time against the fix by hand, fresh processes, interleaved in a random order per round."""
    hand_args, hand_env = CASES[fault][3]
    rng = random.Random(0)
    base, cand = [], []
    # warm the page cache and the imports (40 steps, the last 35 timed: a cold process's first steps are slow);
    # a slow fault (a collapsed affinity: 0.4 s a step) then runs fewer steps, about 3 s of them, at least 20
    first = _ms(("--fault", fault), {}, 40)
    steps = max(20, min(steps, int(3000 / max(first, 1e-3)) + 5))
    for _ in range(rounds):
        sides = [("fault", ("--fault", fault), {}), ("hand", hand_args, hand_env)]
        rng.shuffle(sides)
        for name, args, env in sides:
            (base if name == "fault" else cand).append(_ms(args, env, steps))
    lo, hi = bootstrap_interval(base, cand)
    return {"factor": round(statistics.median(base) / statistics.median(cand), 4), "interval": [round(lo, 4), round(hi, 4)],
            "fault_ms": [round(x, 2) for x in base], "hand_ms": [round(x, 2) for x in cand],
            "hand": {"args": list(hand_args), "env": hand_env}, "steps": steps}


def _fix_entry(report, fault: str) -> dict | None:
    fix, where, _, _ = CASES[fault]
    if fix is None:
        return None
    verify = report.verify.get(fix) if where == "verify" else None
    env = (report.observation.get("env_fixes") or {}).get(fix)
    return verify if verify and "interval" in verify else env


def doctor_run(fault: str, a) -> dict:
    fix, where, rule, _ = CASES[fault]
    job = DoctorJob(script=str(SCRIPT), args=("--fault", fault), steps=a.steps, warmup=5, verify=where == "verify",
                    fixes=(fix,) if where == "verify" else None, rounds=a.rounds,
                    env_rounds=a.rounds if where == "env" else 0, time_limit=600, env={})
    r = diagnose_many([job], quiet=True)[0]
    found = [(g.rule, g.severity) for f in r.findings for g in (f, *f.also)]
    e = _fix_entry(r, fault) or {}
    return {"status": r.status, "findings": found, "severity": dict(found).get(rule),
            "speedup": e.get("speedup"), "interval": e.get("interval"), "rounds": e.get("rounds"),
            "candidate": e.get("candidate") or e.get("label") or e.get("env"), "error": e.get("error")}


def _contains(iv, x: float) -> bool:
    return bool(iv) and iv[0] <= x <= iv[1]


def _overlaps(iv, jv) -> bool:
    return bool(iv) and bool(jv) and iv[0] <= jv[1] and jv[0] <= iv[1]


def run_recovery(a, provenance) -> None:
    faults = a.recovery.split(",") if a.recovery != "all" else list(CASES)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    result = {"benchmark": "doctor_fault_recovery", "claim": "for each injected fault, the interval of the gain the "
              "doctor measures for its fix contains the fault's true factor (the fix made by hand) on 9 runs of 10; "
              "the clean twin gets no finding ranked high or medium", "provenance": provenance(),
              "command": f"python benchmarks/bench_doctor.py --recovery {a.recovery} --repeats {a.repeats} "
                         f"--steps {a.steps} --rounds {a.rounds} --true-rounds {a.true_rounds}",
              "faults": {}, "clean": []}

    def save():
        result.update(wall_s=round(time.perf_counter() - t0, 1),
                      loadavg_1m_before_after=[round(load0, 2), round(os.getloadavg()[0], 2)])
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(result, f, indent=2)
        os.replace(a.out + ".tmp", a.out)

    for fault in faults:
        tf = true_factor(fault, a.true_rounds, a.true_steps)
        result["faults"][fault] = {"fix": CASES[fault][0], "rule": CASES[fault][2], "true": tf, "runs": []}
        print(fault, "true factor", tf["factor"], tf["interval"], flush=True)
        save()
    for i in range(a.repeats):
        for fault in faults:
            run = doctor_run(fault, a)
            row = result["faults"][fault]
            tf = row["true"]
            if CASES[fault][0] is None:  # no fix to measure: recovered when the rule ranks nothing high or medium
                run["contains_true"] = run["overlaps_true"] = run["severity"] not in ("high", "medium")
            else:
                run["contains_true"] = _contains(run["interval"], tf["factor"])
                run["overlaps_true"] = _overlaps(run["interval"], tf["interval"])
            row["runs"].append(run)
            print(i, fault, run["severity"], run["speedup"], run["interval"], "true", tf["factor"],
                  "contains" if run["contains_true"] else "misses", flush=True)
        clean = diagnose_many([DoctorJob(script=str(SCRIPT), args=("--fault", "none"), steps=a.steps, warmup=5,
                                         rounds=a.rounds, env_rounds=a.rounds, time_limit=600, env={})], quiet=True)[0]
        ranked = [(f.rule, f.severity) for f in clean.findings if f.severity in ("high", "medium")]
        result["clean"].append({"status": clean.status, "ranked": ranked,
                                "findings": [(f.rule, f.severity) for f in clean.findings]})
        print(i, "clean twin ranked", ranked, flush=True)
        for fault in faults:
            runs = result["faults"][fault]["runs"]
            result["faults"][fault]["recovered"] = f"{sum(r['contains_true'] for r in runs)} of {len(runs)}"
            result["faults"][fault]["overlapping"] = f"{sum(r['overlaps_true'] for r in runs)} of {len(runs)}"
        result["clean_ranked_runs"] = f"{sum(bool(c['ranked']) for c in result['clean'])} of {len(result['clean'])}"
        save()
    print(json.dumps({f: (v["true"]["factor"], v.get("recovered"), v.get("overlapping"))
                      for f, v in result["faults"].items()}, indent=1), result.get("clean_ranked_runs"))
    print("wrote", a.out)
