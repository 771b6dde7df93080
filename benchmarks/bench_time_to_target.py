"""Claim: on the digits, fit's automatic recipe (`auto`, cold) reaches the target sooner than `all`, `naive` and
Schedule-Free AdamW at its defaults, with choosing counted.

`torchspeed bench`'s time-to-target search finds each config's shortest budget (in steps) to the
target on every seed. Its runs go one config after another, so on a machine whose load changes
the seconds of one config and the next are not comparable. This benchmark takes those budgets
(`--budgets config=steps ...`, from a search's JSON or given) and times each config's complete
run at its budget *interleaved*: round 1 runs every config on seed 0, 1, 2 in turn, round 2 again,
... Each run is the search's own worker process (`bench/time_to_target_worker.py`: cold cache,
the switch trial and the recipe's choosing on the clock, evaluation off it; `auto_warm` reads the cache
an earlier run left, filled off the clock before round 1), started the way the
throughput bench starts that config. Reported per config: the median over rounds of its total
seconds (training + choosing), the final accuracy per seed, and per pair the median of the
per-round ratios.

A search's JSON also gives the workload (model, data, batch, LR, optimizer, training-set size) and the
metric: the GPT's time to the plain loop's loss (`torchspeed bench --model gpt --data text
--target-loss naive`) is timed the same way, the target its validation loss.

Run:
    python benchmarks/bench_time_to_target.py --from /tmp/bench.json --target 0.97 --rounds 2 \
        --json benchmarks/results/cpu-avx2/time_to_target_interleaved.json
    python benchmarks/bench_time_to_target.py --from benchmarks/results/cpu-amx/gpt_time_to_loss.json \
        --configs naive,auto,schedulefree --seeds 2 --rounds 3 --json benchmarks/results/cpu-amx/gpt_interleaved.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from torchspeed.bench.runner import bench_configs, machine_busy, provenance
from torchspeed.bench.time_to_target import CONFIGS, DEFAULT_LR, _process
from torchspeed.env import default_device


DIGITS = {"model": "resnet20", "data": "digits", "batch_size": 64, "train_size": 2048, "val_size": 1024,
          "lr": DEFAULT_LR, "optimizer": "sgd", "image_size": 32}


def _workload(args) -> tuple[dict, str, float | None]:
    """The worker's base spec, the metric and the target: the digits by default, else the source search's own."""
    if not args.source:
        return dict(DIGITS), "val_acc", args.target
    d = json.loads(Path(args.source).read_text())
    meta, tta = d.get("meta", {}), d["tta"]
    tm = tta.get("meta", {})
    base = {"model": tm.get("model", DIGITS["model"]), "data": tm.get("data", DIGITS["data"]),
            "batch_size": tm.get("batch_size", DIGITS["batch_size"]), "lr": tm.get("lr_peak", DIGITS["lr"]),
            "optimizer": tm.get("optimizer", DIGITS["optimizer"]), "image_size": tm.get("image_size", 32)}
    size = tm.get("image_size", 32)  # as run_time_to_target sizes its sets
    base["train_size"] = meta.get("train_size") or (2048 if size < 64 else 4 * base["batch_size"])
    base["val_size"] = 1024 if size < 64 else 2 * base["batch_size"]
    metric = tm.get("metric", "val_acc")
    targets = [e["target"] for e in tta["targets"]]
    target = args.target if metric == "val_acc" or len(targets) != 1 else targets[0]
    return base, metric, target


def _budgets(args, target: float | None) -> dict[str, int]:
    out: dict[str, int] = {}
    if args.source:
        tta = json.loads(Path(args.source).read_text())["tta"]
        entry = next(e for e in tta["targets"] if abs(e["target"] - target) < 1e-9)
        out = {k: v["budget_steps"] for k, v in entry["configs"].items() if v.get("budget_steps")}
    for item in args.budgets or ():
        name, steps = item.split("=")
        out[name] = int(steps)
    bad = set(out) - set(CONFIGS)
    if bad or not out:
        raise SystemExit(f"--budgets: give config=steps for some of {', '.join(CONFIGS)} (got {sorted(out)})")
    return {k: v for k, v in out.items() if k in args.configs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="source", default=None, help="a bench JSON whose time-to-target search gives budgets")
    p.add_argument("--target", type=float, default=0.97)
    p.add_argument("--budgets", nargs="*", help="config=steps, overriding --from")
    p.add_argument("--configs", default="naive,all,auto,schedulefree")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="benchmarks/results/cpu/time_to_target_interleaved.json")
    args = p.parse_args()
    args.configs = tuple(args.configs.split(","))
    base, metric, target = _workload(args)
    budgets = _budgets(args, target)
    dev = default_device(None)
    busy = machine_busy()[0]
    by_name = {c.name: c for c in bench_configs(dev, compile=False, hand=False, busy=busy)}
    base |= {"data_seed": 0, "device": str(dev)}
    seeds = list(range(args.seeds))
    runs: dict[str, list[list[dict]]] = {c: [] for c in budgets}
    warm_root = tempfile.mkdtemp(prefix="torchspeed-warm-")
    warm_dirs = {str(s): os.path.join(warm_root, str(s)) for s in seeds}
    if "auto_warm" in budgets:  # what an earlier run leaves in the cache, measured off the clock
        for s in seeds:
            _process(by_name["all"], base | {"mode": "warm", "seed": s, "config": "auto_warm",
                                            "cache_dir": warm_dirs[str(s)]})
    for r in range(args.rounds):
        for c, steps in budgets.items():  # interleaved: every config once per round, its seeds in one process
            cfg = by_name["naive" if c == "naive" else "all"]
            spec = base | {"mode": "train", "config": c, "seed": seeds[0], "seeds": seeds, "budget": steps,
                           "target": None, "metric": None, "parts": None,
                           "cache_dirs": warm_dirs if c == "auto_warm" else {}}
            out = _process(cfg, spec)["runs"]
            runs[c].append(out)
            total = sum(x["train_s"] + x["tuning_s"] for x in out)
            print(f"round {r + 1} {c:>12} {steps:>3} steps: {total:7.1f} s over {len(out)} seeds, {metric} "
                  + ", ".join(f"{x[metric]:.3f}" for x in out), flush=True)
    per_round = {c: [sum(x["train_s"] + x["tuning_s"] for x in rr) / len(rr) for rr in rs] for c, rs in runs.items()}
    result = {"workload": {k: base[k] for k in DIGITS}, "metric": metric, "target": target, "budgets": budgets, "rounds": args.rounds, "seeds": seeds, "busy": busy,
              "configs": {c: {"budget_steps": budgets[c], "mean_total_s_per_round": per_round[c],
                              "median_total_s": statistics.median(per_round[c]),
                              "val_acc": [[x["val_acc"] for x in rr] for rr in runs[c]],
                              "val_loss": [[x["val_loss"] for x in rr] for rr in runs[c]],
                              "tuning_s": [[x["tuning_s"] for x in rr] for rr in runs[c]],
                              "decisions": runs[c][0][0]["decisions"]} for c in budgets},
              "meta": provenance()}
    ratios = {}
    for b in ("auto", "auto_warm"):
        for a in budgets:
            if b in budgets and a not in ("auto", "auto_warm"):
                ratios[f"{b}_vs_{a}"] = statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))
    result["ratios"] = ratios
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x sooner (median of per-round ratios)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
