"""Benchmark: `torchspeed doctor --verify` on a slow plain-PyTorch CPU training script.

Claim tested: the doctor finds the script's bottlenecks and measures each fix it can apply
(autocast, channels_last, DataLoader workers, conv bias removal, torch.compile) on the
script's own model, baseline and candidate interleaved (5 rounds after warm-up), median of
per-round ratios. Hardware and versions are recorded with the results.

    python benchmarks/bench_doctor.py --rounds 7 --threads 1   # writes benchmarks/results/cpu/doctor_verify.json

`--fix` instead runs `torchspeed doctor --fix` on every script of the doctor's gallery
(tests/doctor/scripts) and on benchmarks/doctor/slow_cpu_train.py: each patch the doctor writes
is measured on the script itself, interleaved with the original, and the kept patches together
end to end; the rule's estimate is recorded beside each measurement, every finding ranked high or
medium once the report is re-ranked with those measurements (`ranked`), and the ranked ones whose
patch gained less than 5% on the real clock (`ranked_below_5pct`, the goal is none); the machine's load
(`torchspeed.env.other_runnable()`, runnable tasks besides this one) before and after each script.

    python benchmarks/bench_doctor.py --fix --steps 20 --rounds 5   # writes benchmarks/results/cpu/doctor_fix.json

`--acceptance` checks the doctor's ranking against the real clock on the gallery: the plain run on
every gallery script (clean, planted, and the scripts in real third-party forms), `--verify` on the
real-form and clean scripts, then every finding ranked high or medium has its fix run on the script
itself (the environment re-run or the `--fix` patch, interleaved with the original in fresh processes;
`--verify`'s own figure where neither applies), and the count of ranked findings that gained under 5%
is reported (goal 0), with clean scripts that got a ranked finding and plants that were missed. Then
the stability scripts run 5 times and each finding's severity is compared across the runs (goal:
unchanged). The machine's load is recorded per script. `--quick` leaves out the 4 slowest planted
scripts, runs 2 rounds per check and one stability script (about 20-25 minutes on 2 busy cores).

    python benchmarks/bench_doctor.py --acceptance --quick   # writes benchmarks/results/<cpu kind>/doctor_acceptance.json

`--recovery all --repeats 10` checks each injected fault of tests/doctor/faults/fault_train.py: the interval of
the gain the doctor measures for its fix against the fault's true factor (the fix made by hand, timed in fresh
processes), and the clean twin's ranked findings (benchmarks/doctor/_recovery.py says how):

    python benchmarks/bench_doctor.py --recovery all --repeats 10   # writes results/cpu-avx512-bf16/doctor_recovery.json

`--stability-only` runs the stability phase alone; `--stability all` runs every gallery script --repeats times:

    python benchmarks/bench_doctor.py --acceptance --stability-only --stability all --repeats 5 \
        --out benchmarks/results/cpu-avx512-bf16/doctor_stability.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from torchspeed.bench.runner import cpu_kind, provenance
from torchspeed.doctor import DoctorJob, diagnose_many

sys.path.insert(0, str(Path(__file__).resolve().parent / "doctor"))
from _acceptance import STABILITY, run_acceptance  # noqa: E402  (the --acceptance mode)
from _recovery import run_recovery  # noqa: E402  (the --recovery mode)

HERE = Path(__file__).resolve().parent


def measure_overhead(rounds: int = 7, steps: int = 50) -> dict:
    """Per-step cost of the probe's instrumentation on a small MLP (interleaved with/without)."""
    import statistics

    import torch
    from torch import nn

    from torchspeed.doctor._probe import Probe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def run():
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - t0) / steps * 1e3

    run()
    plain, probed = [], []
    for _ in range(rounds):
        plain.append(run())
        with Probe(steps=10**9, warmup=0):
            probed.append(run())
    return {"model": "MLP 64-128-128-10, batch 64", "plain_ms": [round(v, 4) for v in plain],
            "probed_ms": [round(v, 4) for v in probed],
            "overhead_ms_per_step": round(statistics.median(p - q for p, q in zip(probed, plain)), 4),
            "overhead_ratio": round(statistics.median(p / q for p, q in zip(probed, plain)), 4)}


def run_fix(a) -> None:
    from torchspeed.doctor import DoctorJob, diagnose_many
    from torchspeed.doctor.fix import fix_script
    from torchspeed.env import other_runnable

    gallery = sorted(p for p in (HERE.parent / "tests" / "doctor" / "scripts").glob("*.py")
                     if not p.name.startswith("_") and p.stem not in ("crashes", "hangs"))
    # the slowest scripts last, so a run cut short still records the rest (the JSON is rewritten per script)
    heavy = ("big_activations", "oversubscribed", "elementwise_chain", "slow_cpu_train")
    scripts = sorted(gallery + [HERE / "doctor" / "slow_cpu_train.py"], key=lambda p: (p.stem in heavy, p.stem))
    if a.only:
        scripts = [s for s in scripts if s.stem in a.only.split(",")]
    rows = []
    prev_path = a.out if a.out != DEFAULT_OUT else str(HERE / "results" / "cpu" / "doctor_fix.json")
    previous = None
    if a.only and os.path.exists(prev_path):
        with open(prev_path) as f:
            previous = json.load(f)
    for path in scripts:
        load = [other_runnable()]
        t0 = time.perf_counter()
        report = diagnose_many([DoctorJob(script=str(path), steps=a.steps, warmup=5, time_limit=600)], quiet=True,
                               threads=a.threads)[0]
        est = {g.rule: g.est_gain for f in report.findings for g in (f, *f.also)}
        row = {"script": str(path.relative_to(HERE.parent)), "status": report.status,
               "findings": [f.rule for f in report.findings],
               "patchable": [f.rule for f in report.findings if f.patch]}
        if row["patchable"] and report.status in ("stopped", "finished"):
            fx = fix_script(report, steps=a.steps, warmup=5, rounds=a.rounds, time_limit=600, threads=a.threads)
            row["patches"] = [{"rule": p["rule"], "patch": p["patch"], "est_gain": est.get(p["rule"]),
                               "speedup": p["speedup"], "ratios": p["ratios"], "kept": p["kept"],
                               "original_ms": fx.get("original_ms"), "patched_ms": p["patched_ms"],
                               **({"error": p["error"]} if "error" in p else {}), "diff": p["diff"]}
                              for p in fx["patches"]]
            row["skipped"] = fx["skipped"]
            row["end_to_end_speedup"] = fx["end_to_end_speedup"]
            row["end_to_end_ratios"] = fx.get("end_to_end_ratios")
            row["combined_diff"] = fx["combined_diff"]
            report = dataclasses.replace(report, fix=fx)  # the findings re-ranked by what --fix measured
        # every finding ranked high or medium, and whether the real clock (--fix on the script) backs it
        fixed = {p["patch"]: p["speedup"] for p in row.get("patches", []) if p["speedup"] is not None}
        row["ranked"] = [{"rule": f.rule, "severity": f.severity, "basis": f.basis, "gain": f.measured_gain or f.est_gain,
                          "fix_measured": fixed.get(f.patch)} for f in report.findings if f.severity != "low"]
        row["ranked_below_5pct"] = [r["rule"] for r in row["ranked"]
                                    if r["fix_measured"] is not None and r["fix_measured"] < 1.05]
        row["seconds"] = round(time.perf_counter() - t0, 1)
        load.append(other_runnable())
        row["other_runnable_before_after"] = load
        rows.append(row)
        print(path.name, "ranked", [(r["rule"], r["severity"]) for r in row["ranked"]],
              "below 5%", row["ranked_below_5pct"], row.get("end_to_end_speedup"), [(p["patch"], p["est_gain"], p["speedup"], p["kept"])
                                                           for p in row.get("patches", [])], "load", load, flush=True)
        result = {"benchmark": "doctor_fix", "claim": "each --fix patch measured on the script itself, interleaved "
                  "with the original; the kept patches together end to end", "provenance": provenance(),
                  "command": "python benchmarks/bench_doctor.py --fix " + " ".join(
                      f"--{k.replace('_', '-')} {v}" for k, v in (("steps", a.steps), ("rounds", a.rounds),
                                                                    ("threads", a.threads), ("only", a.only)) if v),
                  "steps": a.steps, "warmup": 5, "rounds": a.rounds, "threads": a.threads, "scripts": rows}
        out = a.out if a.out != DEFAULT_OUT else str(HERE / "results" / "cpu" / "doctor_fix.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if a.only and previous is not None:  # re-measured scripts replace their rows; the others are kept
            old = previous
            mine = {r["script"] for r in rows}
            result["scripts"] = [r for r in old["scripts"] if r["script"] not in mine] + rows
            result["command"] = old.get("command", "") + "; then " + result["command"]
        with open(out + ".tmp", "w") as f:
            json.dump(result, f, indent=2)
        os.replace(out + ".tmp", out)


DEFAULT_OUT = str(HERE / "results" / "cpu" / "doctor_verify.json")


def run_verdict(a) -> None:
    """`doctor --verify` on one fault of the fault gallery: the verdict, each fix's interval, rounds, loss check."""
    script = HERE.parent / "tests" / "doctor" / "faults" / "fault_train.py"
    job = DoctorJob(script=str(script), args=("--fault", a.verdict), steps=a.steps, warmup=5, verify=True,
                    fixes=("autocast", "channels_last"), rounds=a.rounds, env_rounds=a.rounds, time_limit=600)
    load = os.getloadavg()[0]
    report = diagnose_many([job], quiet=True)[0]
    d = report.to_dict()
    out = a.out if a.out != DEFAULT_OUT else str(HERE / "results" / "cpu-avx512-bf16" / f"doctor_verdict_{a.verdict}.json")
    result = {"benchmark": "doctor_verdict", "provenance": provenance(),
              "command": f"python benchmarks/bench_doctor.py --verdict {a.verdict} --steps {a.steps} --rounds {a.rounds}",
              "loadavg_1m_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
              "verdict": d["verdict"], "findings": [(f["rule"], f["severity"], f["interval"]) for f in d["findings"]],
              "verify": d["verify"]}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["verdict"], indent=1))
    print("wrote", out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fix", action="store_true", help="measure --fix on every gallery script (doctor_fix.json)")
    p.add_argument("--only", default=None, help="with --fix: comma-separated script names (no .py)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads in the script's process")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--acceptance", action="store_true",
                   help="issue 31's acceptance on the gallery: ranked fixes on the real clock, severity over repeats")
    p.add_argument("--quick", action="store_true", help="with --acceptance: fewer steps and rounds, no slow scripts")
    p.add_argument("--check-rounds", type=int, default=None, help="with --acceptance: rounds per real-clock check")
    p.add_argument("--repeats", type=int, default=5, help="with --acceptance: runs of each stability script")
    p.add_argument("--stability", default=",".join(STABILITY),
                   help="with --acceptance: scripts run --repeats times (comma-separated names, or all)")
    p.add_argument("--stability-only", action="store_true", help="with --acceptance: the stability runs alone")
    p.add_argument("--compile", action="store_true", help="with --acceptance: also measure torch.compile in --verify")
    p.add_argument("--verdict", default=None, metavar="FAULT",
                   help="the verdict of `doctor --verify` on tests/doctor/faults/fault_train.py --fault FAULT "
                        "(doctor_verdict_FAULT.json under results/cpu-avx512-bf16/)")
    p.add_argument("--recovery", default=None, metavar="FAULTS",
                   help="fault recovery: comma-separated faults of tests/doctor/faults/fault_train.py, or all "
                        "(doctor_recovery.json); --repeats doctor runs of each")
    p.add_argument("--true-rounds", type=int, default=5, help="with --recovery: rounds a side for the true factor")
    p.add_argument("--true-steps", type=int, default=300, help="with --recovery: steps per true-factor run")
    a = p.parse_args()
    if a.recovery:
        if a.out == DEFAULT_OUT:
            a.out = str(HERE / "results" / "cpu-avx512-bf16" / "doctor_recovery.json")
        a.steps = min(a.steps, 10)
        run_recovery(a, provenance)
        return
    if a.verdict:
        run_verdict(a)
        return
    if a.acceptance:
        if a.out == DEFAULT_OUT:
            a.out = str(HERE / "results" / cpu_kind(provenance()) / "doctor_acceptance.json")  # this CPU's folder
        a.steps = min(a.steps, 10)
        if a.quick:
            a.check_rounds = a.check_rounds or 2
            a.stability = a.stability.split(",")[0]
        a.check_rounds = a.check_rounds or 3
        run_acceptance(a)
        return
    if a.fix:
        run_fix(a)
        return
    fixes = ("autocast", "channels_last", "workers", "conv_bias", "set_to_none") + (() if a.no_compile else ("compile",))
    job = DoctorJob(script=str(HERE / "doctor" / "slow_cpu_train.py"), steps=a.steps, warmup=5, verify=True,
                    fixes=fixes, rounds=a.rounds, time_limit=600)
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    overhead = measure_overhead()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    report = diagnose_many([job], quiet=True, threads=a.threads)[0]
    wall = time.perf_counter() - t0
    result = {"benchmark": "doctor_verify", "claim": __doc__.strip().splitlines()[0], "provenance": provenance(),
              "script": "benchmarks/doctor/slow_cpu_train.py", "steps": a.steps, "rounds": a.rounds,
              "doctor_wall_s": round(wall, 1), "threads": a.threads,
              # other work on the machine makes per-round ratios noisy: record how busy it was
              "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
              "instrumentation_overhead": overhead, "report": report.to_dict(),
              # measured here, not asserted by the test suite: loading in workers beats num_workers=0
              "workers_fix_faster": (report.verify.get("workers") or {}).get("speedup", 0.0) > 1.0}
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
    print("instrumentation overhead", overhead["overhead_ms_per_step"], "ms/step", overhead["overhead_ratio"], "x")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
