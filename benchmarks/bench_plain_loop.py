"""Claim: `fit` is never slower than the plain loop a user writes for a small model (issue: never slower).

Three small models held in memory (`torchspeed.bench.small`: a 1D CNN, an MLP, a tiny
transformer; steps of 1-5 ms on 2 cores), each trained by the script's own ~15-line loop and by
`fit`, in one process, interleaved in rounds after a warm-up round:

- `plain`: the script's loop: Adam at the workload's LR, constant, shuffled index slices of the
  tensors, an evaluation on the 1,000 held-out samples after each epoch;
- `plain_loader`: the same loop over `DataLoader(TensorDataset, batch_size=100, shuffle=True)`
  (the per-sample collate a ported script often has);
- `fit`: `fit(model, DataLoader(TensorDataset...), optimizer="adamw", lr=<same>, weight_decay=0,
  epochs=<same>, val_loader=...)`, every run from an empty decision cache (the switch trial is
  measured on its first steps, counted);
- `auto` (with `--tta`): `fit(recipe="auto")`, cold, with no optimizer or LR given;
- `auto_given` (with `--tta`): `fit(recipe="auto", optimizer="adamw", lr=<the script's>)`, cold;
- `plain_fused` (with `--tta`): the script's loop with Adam's fused kernel: the same update, rounded
  differently (what rounding alone moves);
- `plain_again` (with `--tta`): the script's loop a second time, as a row of its own: the noise floor (an A/A
  reading: what a row that does exactly plain's work reads against plain on this host);
- `plain_bf16_start` (with `--tta`): the script's loop with its first `PERTURB_STEPS` training forwards under
  bf16 autocast, and nothing else changed: the numerics a switch trial's candidate steps give a run's first
  steps. The control for reading `fit` per seed: the target is the script's own final accuracy, so a run
  whose trajectory parts from the script's at all can cross it later or miss it, and never much sooner.

Two readings per workload:

1. **Whole run** (the same epochs): each row's seconds, and fit's speed against plain per round
   (plain seconds / fit seconds; median and quartiles). Goal: at least 1/1.05 = 0.952 against plain,
   above 1.0 against plain_loader.
2. **Time to the plain loop's accuracy** (`--tta`): per seed, the plain loop's final validation
   accuracy less `TOLERANCE` (0.005: 5 of the 1,000 held-out samples) is the target; each row's seconds until its first evaluation at the target,
   evaluations counted. Goal: fit no slower than plain on every seed; auto 1.5x sooner. With `--repeats R` each
   row runs R times a seed, interleaved; per seed the summary gives the median run's ratio and the median over
   rounds of the ratio within a round (`paired_speed_vs_plain`), and `plain_again` the same for plain's own work.

`--isolated`: every run in a process of its own (spawned in the same interleaved order), as a user runs a script
and as `fit` runs in theirs: nothing one row sets in its process (`fit`'s glibc malloc thresholds, torch's lazy
imports and kernels, the trial cache in memory) reaches another row's, and no row is warmed up. Each run's
`seconds` are still from the model's build to its end, and `process_s` beside them is the whole process (the
interpreter, `import torch`, `import torchspeed`, the data), as a user's `time python train.py` reads it.

Run:
    python benchmarks/bench_plain_loop.py                     # whole runs, 3 workloads x 3 rounds
    python benchmarks/bench_plain_loop.py --isolated --rounds 5  # each run in a fresh process
    python benchmarks/bench_plain_loop.py --tta --seeds 0,1,2 # time to the plain loop's accuracy
    python benchmarks/bench_plain_loop.py --tta --seeds 0,1,2,3,4 --repeats 3  # each row and seed 3 times, the median
Writes benchmarks/results/cpu/plain_loop.json (and plain_loop_tta.json) with commit, versions, device; `--out` names
another path (the per-CPU folders, e.g. benchmarks/results/cpu-avx512-bf16/, are written with it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.bench.runner import provenance
from torchspeed.bench.small import SMALL, make_small, plain_loop
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.rounds import ratio_summary


ROWS = ("plain_again", "plain_fused", "plain_bf16_start", "fit", "auto", "auto_given")  # --tta's rows beside plain
PERTURB_STEPS = 5  # plain_bf16_start: training forwards under bf16 autocast at the start (a trial runs about as many)
TOLERANCE = 0.005  # the target: the plain loop's final accuracy less 5 of the 1,000 held-out samples (its noise)


class StopAt(Callback):
    """Stops the run at the first evaluation at or above `target`; remembers when (seconds from `t0`)."""

    def __init__(self, target: float, t0: float):
        self.target, self.t0, self.at = target, t0, None

    def on_evaluate(self, trainer, metrics):
        if self.at is None and metrics.get("val_acc", 0.0) >= self.target:
            self.at = time.perf_counter() - self.t0
            trainer.request_stop(f"val_acc {metrics['val_acc']:.3f} >= {self.target}")


def loaders(w, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (DataLoader(TensorDataset(w.x, w.y), batch_size=w.batch_size, shuffle=True, generator=g),
            DataLoader(TensorDataset(w.vx, w.vy), batch_size=500))


def run_fit(w, *, epochs: int, seed: int, recipe: str | None = None, target: float | None = None,
            given: bool = True) -> dict:
    """One cold `fit` run (a fresh decision cache); seconds to the end, or to `target` when given."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHSPEED_CACHE_DIR"] = cache
        torch.manual_seed(seed)
        model = w.model()
        train, val = loaders(w, seed)
        t0 = time.perf_counter()
        stop = StopAt(target, t0) if target is not None else None
        kw = dict(optimizer="adamw", lr=w.lr, weight_decay=0.0) if given else {}  # the script's optimizer and LR
        if recipe:
            kw["recipe"] = recipe
        res = torchspeed.fit(model, train, epochs=epochs, val_loader=val, progress=False,
                             callbacks=[stop] if stop else None, **kw)
        seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "steps": res.steps, "val_acc": res.final.get("val_acc"),
           "eval_share": res.decisions["evaluation"].value if "evaluation" in res.decisions else None,
           "decisions": {k: str(d.value)[:60] for k, d in res.decisions.items()}}
    if target is not None:
        out["to_target_s"] = stop.at
    return out


class Bf16First(torch.nn.Module):
    """`model` with its first `steps` training forwards under bf16 autocast (the control row)."""

    def __init__(self, model: torch.nn.Module, steps: int):
        super().__init__()
        self.model, self.left = model, steps

    def forward(self, x):
        if self.training and self.left > 0:
            self.left -= 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(x).float()
        return self.model(x)


def run_plain(w, *, epochs: int, seed: int, loader: bool = False, target: float | None = None,
              fused: bool | None = None, bf16_start: int = 0) -> dict:
    torch.manual_seed(seed)
    model = w.model()
    model = Bf16First(model, bf16_start) if bf16_start else model
    t0, at = time.perf_counter(), [None]

    def on_epoch(_, acc):
        if target is not None and at[0] is None and acc >= target:
            at[0] = time.perf_counter() - t0
            return True
        return False

    out = plain_loop(model, w, epochs=epochs, seed=seed, on_epoch=on_epoch,
                     loader=loaders(w, seed)[0] if loader else None, fused=fused)  # loader: over a DataLoader
    out["seconds"] = time.perf_counter() - t0  # from the model's build, as fit's: the optimizer's first build too
    if target is not None:
        out["to_target_s"] = at[0]
    return out


# row -> (the function, its options): what a row runs, in this process or in one of its own (`--isolated`)
ROW_SPECS = {"plain": ("plain", {}), "plain_again": ("plain", {}), "plain_loader": ("plain", {"loader": True}),
             "plain_fused": ("plain", {"fused": True}), "plain_bf16_start": ("plain", {"bf16_start": PERTURB_STEPS}),
             "fit": ("fit", {}), "auto": ("fit", {"recipe": "auto", "given": False}),
             "auto_given": ("fit", {"recipe": "auto"})}


def _run_row(row: str, name: str, *, epochs: int, seed: int, target: float | None = None,
             isolated: bool = False) -> dict:
    """One run of `row` on workload `name`: here, or (`isolated`) in a fresh Python process, whose whole wall time
    is `process_s`."""
    if isolated:
        import subprocess
        import sys
        spec = dict(row=row, name=name, epochs=epochs, seed=seed, target=target)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                              timeout=900, env=os.environ | {"PYTHONHASHSEED": "0"})
        process_s = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"{row} on {name} (seed {seed}) failed in its process:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1]) | {"process_s": process_s}
    fn, kw = ROW_SPECS[row]
    w = _workload(name)
    if fn == "plain":
        return run_plain(w, epochs=epochs, seed=seed, target=target, **kw)
    return run_fit(w, epochs=epochs, seed=seed, target=target, **kw)


_WORKLOADS: dict = {}


def _workload(name: str):
    if name not in _WORKLOADS:
        _WORKLOADS[name] = make_small(name)
    return _WORKLOADS[name]


def whole_runs(names, *, epochs: int, rounds: int, isolated: bool = False) -> dict:
    out = {}
    for name in names:
        rows = {k: (lambda k=k: _run_row(k, name, epochs=epochs, seed=0, isolated=isolated))
                for k in ("plain", "plain_loader", "fit")}
        if not isolated:  # warm-up: first-call set-up (torch's lazy imports, kernels), untimed
            for fn in rows.values():
                fn()
        samples: dict[str, list] = {k: [] for k in rows}
        for r in range(rounds):
            for k in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
                samples[k].append(rows[k]())
        secs = {k: [s["seconds"] for s in v] for k, v in samples.items()}
        ratio = lambda a, b: ratio_summary([x / y for x, y in zip(secs[a], secs[b])])  # noqa: E731
        extra = {}
        if isolated:
            procs = {k: [s["process_s"] for s in v] for k, v in samples.items()}
            extra = {"process_s": procs, "fit_process_speed_vs_plain": ratio_summary(
                [x / y for x, y in zip(procs["plain"], procs["fit"])])}
        out[name] = extra | {"epochs": epochs, "steps": samples["plain"][0]["steps"],
                     "step_ms_plain": 1000 * statistics.median(secs["plain"]) / samples["plain"][0]["steps"],
                     "seconds": secs, "median_s": {k: statistics.median(v) for k, v in secs.items()},
                     "fit_speed_vs_plain": ratio("plain", "fit"), "fit_speed_vs_plain_loader": ratio("plain_loader", "fit"),
                     "val_acc": {k: [s["val_acc"] for s in v] for k, v in samples.items()},
                     "fit_eval_share": [s["eval_share"] for s in samples["fit"]],
                     "fit_decisions": samples["fit"][-1]["decisions"]}
        m = out[name]["median_s"]
        print(f"{name}: plain {m['plain']:.2f} s, plain_loader {m['plain_loader']:.2f} s, fit {m['fit']:.2f} s; "
              f"fit's speed vs plain {out[name]['fit_speed_vs_plain']}", flush=True)
    return out


def _median_run(runs: list[dict]) -> dict:
    """Of repeated runs of one row and seed (the same steps: each run is deterministic), the one with the median
    seconds to the target (a missed target counts as the slowest), with every run's seconds beside it."""
    key = lambda r: r["to_target_s"] if r["to_target_s"] is not None else float("inf")  # noqa: E731
    ranked = sorted(runs, key=key)
    out = ranked[(len(ranked) - 1) // 2] | {"to_target_runs": [r["to_target_s"] for r in runs]}
    if all("process_s" in r for r in runs):  # --isolated: each process's whole seconds (it ends at the target)
        out["process_runs"] = [r["process_s"] if r["to_target_s"] is not None else None for r in runs]
    return out


def to_target(names, *, epochs: int, seeds: list[int], repeats: int = 1, keep: tuple = ROWS,
              isolated: bool = False) -> dict:
    out = {}
    for name in names:
        if not isolated:  # warm-up
            _run_row("plain", name, epochs=1, seed=0), _run_row("fit", name, epochs=1, seed=0)
        per_seed = []
        for seed in seeds:
            target = _run_row("plain", name, epochs=epochs, seed=seed, isolated=isolated)["val_acc"] - TOLERANCE
            rows = {k: (lambda k=k, seed=seed, target=target: _run_row(k, name, epochs=epochs, seed=seed,
                                                                       target=target, isolated=isolated))
                    for k in ("plain",) + ROWS if k == "plain" or k in keep}
            runs: dict[str, list] = {k: [] for k in rows}
            for r in range(repeats):  # interleaved rounds: a slow phase of the machine hits every row alike
                for k in (list(rows) if r % 2 == 0 else list(rows)[::-1]):
                    runs[k].append(rows[k]())
            row = {"seed": seed, "target": target} | {k: _median_run(v) for k, v in runs.items()}
            per_seed.append(row)
            print(f"{name} seed {seed}: target {target:.3f}; " + ", ".join(
                f"{k} {_s(row[k]['to_target_s'])}" for k in rows),
                flush=True)
        out[name] = {"epochs": epochs, "seeds": per_seed}
    return out


def _s(seconds: float | None) -> str:
    return "missed" if seconds is None else f"{seconds:.2f} s"


def _paired(plain: list, row: list) -> float:
    """The median over rounds of plain's seconds over the row's in the same round (a missed target counts as 0)."""
    return statistics.median(a / b if a and b else 0.0 for a, b in zip(plain, row))


def summary(result: dict) -> dict:
    """Per workload and row: the seeds' seconds to the target (None: missed), and the speed against plain."""
    out = {}
    for name, w in result.items():
        rows = {}
        for k in ROWS:
            if not any(k in s for s in w["seeds"]):
                continue
            speed = [s["plain"]["to_target_s"] / s[k]["to_target_s"] if s[k]["to_target_s"] else 0.0
                     for s in w["seeds"] if k in s]
            paired = [_paired(s["plain"]["to_target_runs"], s[k]["to_target_runs"]) for s in w["seeds"] if k in s]
            row = {"speed_vs_plain": [round(v, 3) for v in speed], "min": round(min(speed), 3),
                   "median": round(statistics.median(speed), 3),
                   # per seed, the median over repeats of plain's seconds / the row's in the same round
                   "paired_speed_vs_plain": [round(v, 3) for v in paired], "paired_min": round(min(paired), 3),
                   "reached": sum(s[k]["to_target_s"] is not None for s in w["seeds"]),
                   # the plain loop's run exactly: crossed at its step with its accuracy (its numerics kept)
                   "same_run_as_plain": sum(s[k]["steps"] == s["plain"]["steps"] and
                                            s[k]["val_acc"] == s["plain"]["val_acc"] for s in w["seeds"])}
            if all("process_runs" in s[k] for s in w["seeds"] if k in s):  # --isolated: whole processes, paired
                proc = [_paired(s["plain"]["process_runs"], s[k]["process_runs"]) for s in w["seeds"] if k in s]
                row |= {"process_speed_vs_plain": [round(v, 3) for v in proc], "process_min": round(min(proc), 3)}
            rows[k] = row
        out[name] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(SMALL))
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tta", action="store_true", help="time to the plain loop's accuracy instead of whole runs")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--repeats", type=int, default=1, help="--tta: runs per row and seed, interleaved; the median")
    ap.add_argument("--rows", default=",".join(ROWS), help="--tta: the rows beside plain (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--isolated", action="store_true", help="every run in a fresh process of its own, no warm-up")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one isolated run: its spec as JSON
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        res = _run_row(spec["row"], spec["name"], epochs=spec["epochs"], seed=spec["seed"], target=spec["target"])
        print(json.dumps(res, default=str))
        return
    names = args.workloads.split(",")
    if args.tta:
        result = {"kind": "time_to_plain_accuracy",
                  "repeats": args.repeats,
                  "isolated": args.isolated,
                  "workloads": to_target(names, epochs=args.epochs, seeds=[int(s) for s in args.seeds.split(",")],
                                         repeats=args.repeats, keep=tuple(args.rows.split(",")),
                                         isolated=args.isolated)}
        result["summary"] = summary(result["workloads"])
        print(json.dumps(result["summary"], indent=1))
    else:
        result = {"kind": "whole_run", "isolated": args.isolated,
                  "workloads": whole_runs(names, epochs=args.epochs, rounds=args.rounds, isolated=args.isolated)}
    result["provenance"] = provenance()
    path = Path(args.out or f"benchmarks/results/cpu/plain_loop{'_tta' if args.tta else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
