"""Claim: the switch trial's share of a `fit(recipe="auto")` run (`autoswitch.PRICE_SHARE`) at 8% reaches the plain
loop's loss sooner than at a quarter on runs too short for the trial to pay back, and changes nothing on runs long
enough to afford it.

Two parts, each run cold (an empty decision cache every run), in one process, the ways interleaved with their order
alternating round by round after a warm-up:

- **zoo**: models of the zoo (benchmarks/zoo_*.py) trained K steps by the plain loop and by `fit(recipe="auto")` at
  each share. Per share: the whole run's ratio (the plain loop's seconds over the run's) and the ratio to the plain
  loop's loss (its last tenth's average; `zoo_run.reach_seconds`: when the run's training loss, averaged over a
  tenth, fell to it, choosing and trial counted; never: 0), the median over rounds; and what each run chose.
- **suite**: the suite's `auto` row (torchspeed.bench.suite_run.run_row) at each share, seconds to each workload's
  target with choosing counted, per seed.

Run:
    python benchmarks/bench_trial_share.py --models timm/gernet_s timm/efficientnet_b0 regnet_x_3_2gf \
        timm/rdnet_tiny timm/cspresnet50 --steps 12 --rounds 3 --shares 0.25 0.08 \
        --json benchmarks/results/cpu-avx512-bf16/trial_share.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zoo_run import batches_for, fit_run, plain_loop, registry, reach_seconds, settings, warm_up, window  # noqa: E402

from torchspeed._io import write_json  # noqa: E402
from torchspeed.bench import suite_run  # noqa: E402
from torchspeed.bench.runner import provenance  # noqa: E402
from torchspeed.bench.suite import load_data, suite_workloads  # noqa: E402
from torchspeed.train.trial import autoswitch  # noqa: E402

SOURCES = {"timm": "timm", "hf": "transformers", "hand": "hand"}


def _auto_round(case, batches, share: float, target: float) -> dict:
    autoswitch.PRICE_SHARE = share
    curve: list = []
    sec, _, res = fit_run(case, batches, True, curve)
    s = settings(res)
    reach = reach_seconds(curve, target, window(len(batches)))[0]
    return {"seconds": sec, "reach_s": reach, "precision": s["precision"], "channels_last": s["channels_last"],
            "switch_trial": s.get("switch_trial_reason", s["switch_trial"])}


def zoo_model(name: str, steps: int, rounds: int, shares: list[float]) -> dict:
    case = registry((SOURCES.get(name.split("/")[0], "torchvision"),))[name]
    batches = batches_for(case, steps)
    warm_up(case, batches)
    runs: dict = {"plain": [], **{str(s): [] for s in shares}}
    targets = []
    for r in range(rounds):
        ways = ["plain", *shares]
        for way in ways if r % 2 == 0 else ways[::-1]:
            if way == "plain":
                sec, _, losses = plain_loop(case, batches)
                w = window(len(losses))
                targets.append(sum(losses[-w:]) / w)
                runs["plain"].append({"seconds": sec})
            else:
                target = targets[-1] if targets else math.inf  # round 2's first way: the last plain round's
                runs[str(way)].append(_auto_round(case, batches, way, target))
    plain_s = statistics.median(x["seconds"] for x in runs["plain"])
    out = {"steps": steps, "plain_s": plain_s, "runs": runs, "shares": {}}
    for s in shares:
        rs = runs[str(s)]
        reach = statistics.median(x["reach_s"] if x["reach_s"] is not None else math.inf for x in rs)
        out["shares"][str(s)] = {"whole_vs_plain": plain_s / statistics.median(x["seconds"] for x in rs),
                                 "reach_vs_plain": plain_s / reach if reach else 0.0,
                                 "chose": [x["precision"] + ("+CL" if x["channels_last"] else "") for x in rs]}
    return out


def suite_rows(seeds: list[int], shares: list[float], names: list[str] | None = None) -> dict:
    out = {}
    for w in suite_workloads(names):
        data = load_data(w)
        suite_run.run_row(w, "auto", 0, data)  # warm-up: imports, first-call costs (not timed)
        rows: dict = {str(s): [] for s in shares}
        for k, seed in enumerate(seeds):
            for s in shares if k % 2 == 0 else shares[::-1]:
                autoswitch.PRICE_SHARE = s
                r = suite_run.run_row(w, "auto", seed, data)
                rows[str(s)].append({"seed": seed, "to_target_s": r["to_target_s"], "steps": r["steps_to_target"],
                                     "precision": r["decisions"].get("precision", ""),
                                     "channels_last": r["decisions"].get("channels_last", "")[:5]})
        out[w.name] = rows
        print(w.name, {s: [(x["to_target_s"] and round(x["to_target_s"], 2), x["precision"][:40]) for x in v]
                       for s, v in rows.items()}, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.08])
    p.add_argument("--suite-seeds", type=int, nargs="*", default=[0, 1])
    p.add_argument("--suite-workloads", nargs="*", default=None, help="the suite's workloads (default: all)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    saved = autoswitch.PRICE_SHARE
    res = {"provenance": provenance(), "shares": args.shares, "command": " ".join(sys.argv), "zoo": {}}
    try:
        for name in args.models:
            res["zoo"][name] = m = zoo_model(name, args.steps, args.rounds, args.shares)
            print(name, f"plain {m['plain_s']:.2f} s", {s: {k: (round(v, 2) if isinstance(v, float) else v)
                                                           for k, v in x.items()} for s, x in m["shares"].items()},
                  flush=True)
        if args.suite_seeds:
            res["suite"] = suite_rows(args.suite_seeds, args.shares, args.suite_workloads)
    finally:
        autoswitch.PRICE_SHARE = saved
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
