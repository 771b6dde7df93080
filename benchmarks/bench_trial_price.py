"""Claim: pricing the switch trial in seconds (train/trial/switches.LiveTrial._price) never makes `fit` reach its target
later, and makes it sooner where a short run's trial cost more than it could win.

For every workload of the suite (torchspeed.bench.suite) and seed, interleaved in one process from a cold decision
cache: the plain loop (`naive`), `fit` as the suite's `fit` row calls it (the trial priced: `PRICE_SHARE` 0.25),
and the same `fit` with the trial unpriced (`PRICE_SHARE` infinite: the trial as it was). Seconds to the target
with choosing counted (suite_run.run_row); per workload the median over seeds and the priced/unpriced ratio
(above 1: pricing is sooner); and whether the priced runs stopped their trial.

Run:
    python benchmarks/bench_trial_price.py --seeds 0 1 2 --json benchmarks/results/cpu-avx512-bf16/trial_price.json
"""

from __future__ import annotations

import argparse
import math
import statistics

from torchspeed._io import write_json
from torchspeed.bench import suite_run
from torchspeed.bench.runner import provenance
from torchspeed.bench.suite import load_data, suite_workloads
from torchspeed.train.trial import autoswitch

ROWS = ("naive", "fit_priced", "fit_unpriced")


def one(w, row: str, seed: int, data, cap_s: float) -> dict:
    if row == "naive":
        return suite_run.run_row(w, "naive", seed, data, cap_s=cap_s)
    saved = autoswitch.PRICE_SHARE
    autoswitch.PRICE_SHARE = saved if row == "fit_priced" else math.inf
    try:
        out = suite_run.run_row(w, "fit", seed, data, cap_s=cap_s)
    finally:
        autoswitch.PRICE_SHARE = saved
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workloads", nargs="*", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res = {"provenance": provenance(), "price_share": autoswitch.PRICE_SHARE, "workloads": {}}
    for w in suite_workloads(args.workloads):
        data = load_data(w)
        suite_run.run_row(w, "fit", 0, data)  # warm-up: imports, first-call costs (not timed)
        cap = 20 * max(1.0, suite_run.run_row(w, "naive", 0, data)["seconds"])
        runs = {r: [] for r in ROWS}
        for k, seed in enumerate(args.seeds):
            order = ROWS if k % 2 == 0 else ROWS[::-1]  # interleaved, the order alternating per seed
            for row in order:
                runs[row].append(one(w, row, seed, data, cap))
        med = {r: statistics.median(x["to_target_s"] if x["to_target_s"] is not None else math.inf for x in v)
               for r, v in runs.items()}
        ratios = [b["to_target_s"] / a["to_target_s"] for a, b in zip(runs["fit_priced"], runs["fit_unpriced"])
                  if a["to_target_s"] and b["to_target_s"]]
        stopped = ["stopped" in x["decisions"].get("precision", "") or "kept the plain" in
                   x["decisions"].get("precision", "") for x in runs["fit_priced"]]
        res["workloads"][w.name] = {"median_to_target_s": med, "priced_vs_unpriced": ratios,
                                    "median_ratio": statistics.median(ratios) if ratios else None,
                                    "priced_trial_stopped": stopped, "runs": runs}
        print(f"{w.name:>12}: naive {med['naive']:.2f} s, fit priced {med['fit_priced']:.2f} s, unpriced "
              f"{med['fit_unpriced']:.2f} s, unpriced/priced {res['workloads'][w.name]['median_ratio']}, "
              f"stopped {stopped}", flush=True)
    ratios = [v["median_ratio"] for v in res["workloads"].values() if v["median_ratio"]]
    res["geomean_ratio"] = math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None
    print(f"geometric mean, unpriced/priced seconds to target: {res['geomean_ratio']}")
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
