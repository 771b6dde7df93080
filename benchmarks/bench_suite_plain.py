"""The suite's plain loops: each workload's seconds and steps to its target (docs/suite.md's measured table).

For every registered workload (`torchspeed.bench.suite`): one warm-up epoch, then `plain_to_target` for
each seed, `--repeats` times a seed, keeping the fastest run (the steps are the same in every run; the
seconds are the least disturbed by whatever else the machine runs). Prints the table's rows and writes
benchmarks/results/cpu/suite_plain.json with commit, versions, device and the load average.

Run:
    python benchmarks/bench_suite_plain.py                  # all workloads, seeds 0,1,2, best of 3
    python benchmarks/bench_suite_plain.py --workloads mlp --seeds 0 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from torchspeed.bench.runner import provenance
from torchspeed.bench.suite import load_data, plain_run, plain_to_target, suite_workloads


def measure(w, seeds: list[int], repeats: int) -> dict:
    d = load_data(w)
    plain_run(w, 0, epochs=1, data=d)  # warm-up: first-call set-up, untimed
    best = [min((plain_to_target(w, s) for _ in range(repeats)), key=lambda r: r["seconds"]) for s in seeds]
    return {"budget_steps": -(-len(d.x) // w.batch_size) * w.epochs, "target": w.target, "metric": w.metric,
            "to_target_s": [r["to_target_s"] for r in best], "to_target_steps": [r["to_target_steps"] for r in best],
            "ms_per_step": statistics.median(1000 * r["seconds"] / r["steps"] for r in best),
            "history": [r["history"] for r in best]}


def row(name: str, m: dict) -> str:
    secs = [s for s in m["to_target_s"] if s is not None]
    median = f"{statistics.median(secs):.2f} s" if len(secs) == len(m["to_target_s"]) else "missed"
    each = ", ".join("missed" if s is None else f"{s:.2f}" for s in m["to_target_s"])
    steps = ", ".join(str(s) for s in m["to_target_steps"])
    return f"| `{name}` | {median} ({each}) | {steps} of {m['budget_steps']} | {m['ms_per_step']:.1f} ms |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=None, help="comma-separated names (default: every registered one)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu/suite_plain.json")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"load_before": os.getloadavg(), "workloads": {}}
    print("| workload | seconds to target: median (seeds) | steps to target (seeds) of the budget | ms a step |")
    print("|---|---|---|---|")
    for w in suite_workloads(args.workloads.split(",") if args.workloads else None):
        result["workloads"][w.name] = measure(w, seeds, args.repeats)
        print(row(w.name, result["workloads"][w.name]), flush=True)
    result["load_after"] = os.getloadavg()
    result["provenance"] = provenance()
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
