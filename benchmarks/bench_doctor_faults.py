"""Claim: the allocator rule's count line (`rules.allocator.FAULTS`, 500 minor page faults a step) sits far from
where the doctor gallery's scripts live, in every process.

Each gallery script (tests/doctor/scripts, but the crash and hang scripts) gets `--runs` plain doctor runs with no
environment re-runs (`env_rounds=0`: the probe alone, 30 timed steps after 3 of warm-up); the JSON keeps each run's
minor page faults per step (the mean over the kept steps, what the rule reads), its step time and allocator.

Run:
    python benchmarks/bench_doctor_faults.py --runs 2 --out benchmarks/results/cpu-avx512-bf16/doctor_faults.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from torchspeed.bench.runner import provenance
from torchspeed.doctor import DoctorJob, diagnose_many
from torchspeed.doctor.rules.allocator import FAULTS

HERE = Path(__file__).resolve().parent
SKIP = {"crashes", "hangs"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default="doctor_faults.json")
    a = ap.parse_args()
    scripts = sorted(p for p in (HERE.parent / "tests" / "doctor" / "scripts").glob("*.py")
                     if not p.stem.startswith("_") and p.stem not in SKIP)
    t0, runs = time.perf_counter(), {p.stem: [] for p in scripts}
    for _ in range(a.runs):
        reports = diagnose_many([DoctorJob(script=str(p), steps=30, warmup=3, time_limit=120, env_rounds=0)
                                 for p in scripts], quiet=True)
        for p, r in zip(scripts, reports):
            b = r.breakdown or {}
            runs[p.stem].append({"faults_per_step": b.get("minor_faults_per_step"), "step_ms": b.get("step_ms"),
                                 "allocator": (r.env or {}).get("allocator"), "status": r.status})
            print(p.stem, runs[p.stem][-1], flush=True)
    counts = {k: [r["faults_per_step"] or 0.0 for r in v] for k, v in runs.items()}
    out = {"benchmark": "doctor_faults", "claim": __doc__.split("\n\n")[0], "provenance": provenance(),
           "command": f"python benchmarks/bench_doctor_faults.py --runs {a.runs}", "line": FAULTS, "runs": runs,
           "summary": {"over_the_line_every_run": sorted(k for k, c in counts.items() if min(c) >= FAULTS),
                       "under_the_line_every_run": len([k for k, c in counts.items() if max(c) < FAULTS]),
                       "on_both_sides": sorted(k for k, c in counts.items() if min(c) < FAULTS <= max(c)),
                       "nearest_under": sorted(((max(c), k) for k, c in counts.items() if max(c) < FAULTS),
                                               reverse=True)[:3]},
           "wall_s": round(time.perf_counter() - t0, 1)}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"]), f"({out['wall_s']} s)")


if __name__ == "__main__":
    main()
