"""Claim: where a zoo sweep read `fit` as ported under 0.97x of the plain loop, more interleaved rounds say whether
that is a cost of `fit` or the sweep's noise.

A sweep (`bench_zoo.py`) times each model's plain loop and `fit` for a few rounds (3 in the curve sweeps) and
keeps the ratio of the medians. On 2 busy cores one round of a 12-step run of a large model moves by 10-20%, so a
model at parity can read 0.85x. This re-runs each model the sweep read under `--below` (or those named), each in
its own process with the sweep's CPU profile: a warm-up, then `--rounds` rounds of the plain loop and `fit` on the
same K steps as the sweep (its recorded `steps`), the order alternating per round. Per model: the rounds' seconds,
the ratio of the medians, its 95% paired bootstrap interval (`torchspeed.doctor._interval`), and a verdict:
`no slower` (the ratio >= `--below`), `slower` (the whole interval under it: a cost to find at its source) or
`within noise` (the interval holds it).

Run:
    python benchmarks/bench_zoo_recheck.py --sweep benchmarks/results/cpu-avx512-bf16/zoo_curve_ad06138.json \\
        --rounds 9 --out benchmarks/results/cpu-avx512-bf16/zoo_recheck_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from bench_zoo_pair import rounds_in_child  # the same child: a warm-up, then rounds in alternating order


def verdict(plain: list[float], fit: list[float], below: float) -> dict:
    """The ratio of the medians (the plain loop's seconds over fit's: above 1, fit is faster), its interval and
    what it says against `below`."""
    from torchspeed.doctor._interval import bootstrap_interval

    ratio = statistics.median(plain) / statistics.median(fit)
    lo, hi = bootstrap_interval(plain, fit)  # paired rounds: the speed-up of fit over the plain loop
    says = "no slower" if ratio >= below else "slower" if hi < below else "within noise"
    return {"vs_plain": round(ratio, 4), "interval": [round(lo, 4), round(hi, 4)], "verdict": says}


def one(case: str, steps: int, rounds: int, profile: str | None) -> dict:
    env = dict(os.environ)
    env.pop("TORCHSPEED_CPU_PROFILE", None)
    if profile and profile != "host":
        env["TORCHSPEED_CPU_PROFILE"] = profile
    return rounds_in_child(case, steps, rounds, env)


def chosen(sweep: dict, below: float, names: list[str] | None) -> list[tuple[str, dict]]:
    """(name, the sweep's fit row) for the models to recheck: those named, else every finished `fit` run under
    `below`."""
    rows = {n: m["runs"].get("fit") or {} for n, m in sweep["models"].items()}
    if names:
        return [(n, rows[n]) for n in names]
    return sorted(((n, r) for n, r in rows.items() if r.get("finished") and r.get("vs_plain", 1.0) < below),
                  key=lambda x: x[1]["vs_plain"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", required=True, help="a bench_zoo.py JSON")
    ap.add_argument("--below", type=float, default=0.97)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--models", nargs="*", help="recheck these (default: every fit run the sweep read under --below)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from torchspeed.bench.runner import provenance

    sweep = json.loads(Path(a.sweep).read_text())
    profile = sweep.get("profile") or "host"
    t0, models = time.perf_counter(), {}
    result = {"benchmark": "zoo_recheck", "claim": __doc__.split("\n\n")[0], "provenance": provenance(),
              "command": f"python benchmarks/bench_zoo_recheck.py --sweep {a.sweep} --below {a.below} "
                         f"--rounds {a.rounds}" + (f" --models {' '.join(a.models)}" if a.models else ""),
              "sweep": {"file": Path(a.sweep).name, "commit": sweep.get("commit"), "rounds": sweep.get("rounds")},
              "profile": profile, "below": a.below, "rounds": a.rounds, "models": models}
    for name, row in chosen(sweep, a.below, a.models):
        steps = int(row.get("steps") or sweep.get("K") or 12)
        try:
            r = one(name, steps, a.rounds, profile)
        except subprocess.CalledProcessError as e:
            models[name] = {"steps": steps, "sweep_vs_plain": row.get("vs_plain"), "error": (e.stderr or "")[-600:]}
            continue
        models[name] = {"steps": steps, "sweep_vs_plain": round(row.get("vs_plain", 0.0), 4),
                        **verdict(r["plain_s"], r["fit_s"], a.below),
                        "plain_s": [round(x, 4) for x in r["plain_s"]], "fit_s": [round(x, 4) for x in r["fit_s"]]}
        m = models[name]
        print(f"{name}: sweep {m['sweep_vs_plain']:.3f}x, now {m['vs_plain']:.3f}x {m['interval']} {m['verdict']}",
              flush=True)
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    says = [m.get("verdict", "error") for m in models.values()]
    result["summary"] = {k: says.count(k) for k in ("no slower", "within noise", "slower", "error")}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
