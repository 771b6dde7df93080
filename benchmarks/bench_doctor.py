"""Benchmark: `torchspeed doctor --verify` on a slow plain-PyTorch CPU training script.

Claim tested: the doctor finds the script's bottlenecks and measures each fix it can apply
(autocast, channels_last, DataLoader workers, conv bias removal, torch.compile) on the
script's own model, baseline and candidate interleaved (5 rounds after warm-up), median of
per-round ratios. Hardware and versions are recorded with the results.

    python benchmarks/bench_doctor.py            # writes benchmarks/results/cpu/doctor_verify.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from torchspeed.bench.runner import provenance
from torchspeed.doctor import DoctorJob, diagnose_many

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", default=str(HERE / "results" / "cpu" / "doctor_verify.json"))
    a = p.parse_args()
    fixes = ("autocast", "channels_last", "workers", "conv_bias", "set_to_none") + (() if a.no_compile else ("compile",))
    job = DoctorJob(script=str(HERE / "doctor" / "slow_cpu_train.py"), steps=a.steps, warmup=5, verify=True,
                    fixes=fixes, rounds=a.rounds, time_limit=600)
    t0 = time.perf_counter()
    report = diagnose_many([job], quiet=True)[0]
    wall = time.perf_counter() - t0
    result = {"benchmark": "doctor_verify", "claim": __doc__.strip().splitlines()[0], "provenance": provenance(),
              "script": "benchmarks/doctor/slow_cpu_train.py", "steps": a.steps, "rounds": a.rounds,
              "doctor_wall_s": round(wall, 1), "report": report.to_dict()}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, a.out)
    b = report.breakdown
    print(f"step {b.get('step_ms', 0):.1f} ms: data {b['fractions']['data_wait']:.0%}, compute {b['fractions']['compute']:.0%}")
    for f in report.findings:
        m = f" measured {f.measured_gain:.2f}x" if f.measured_gain is not None else ""
        print(f"{f.severity:6s} {f.rule:22s} est {f.est_gain}{m}")
    for v in report.verify.values():
        print(v["fix"], v.get("speedup"), v.get("ratios"), v.get("error", ""))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
