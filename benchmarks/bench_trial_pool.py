"""Claim: a close cached switch choice measured again by the next runs and pooled (`train/trial/pool.py`) settles on
a faster setting than the first run's choice read as final, for what the runs that measure again spend.

Models as `bench_switches.py` runs them (torchvision's, or timm's as `timm:NAME`, 10 classes, 32 px, batch 32, SGD
one-cycle at the LR given: a ported run), every run a fresh process, as a user's next run is:

- **truth**: each manual precision x layout setting (`trial=False`) trains `--truth-steps` steps, timed as a whole
  `fit`, in `--truth-rounds` interleaved rounds; its median seconds. The best is the fastest median.
- **sequences**: `--sequences` times, `--runs` runs of a `--run-steps`-step `fit` one after another on one fresh
  decision cache (the first cold, the next reading what the earlier left), each stopped once its switch trial has
  decided (the choice is what is measured here; a whole run's time in that setting is the truth's). The trees given
  (`--trees`, source folders put first on PYTHONPATH; the first is the baseline) take their turns run by run,
  the order alternating.

Per sequence and tree: the setting the last run settled on (what every later run reads), its truth seconds over the
best's ("settled / best": 1.0 is the best setting, above it slower), and the trial steps each run spent.

Run:
    python benchmarks/bench_trial_pool.py --trees OLD/src NEW/src --models resnet18 timm:mobilenetv3_small_050 \\
        --out benchmarks/results/cpu-avx512-bf16/trial_pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    """One run in this process: print its seconds and the switches it trained in, as JSON."""
    sys.path.insert(0, str(HERE))
    import torchspeed
    from bench_switches import _loader, _model
    from torchspeed.train import Callback

    class StopWhenDecided(Callback):
        def on_step_end(self, trainer):
            trial = trainer.decisions.get("switch_trial")
            if args.stop_after_trial and trial is not None and trial.value != "pending":
                trainer.request_stop("the switch trial decided")

    fixed = json.loads(args.fixed) if args.fixed else {}
    kw = dict(trial=False, **fixed) if fixed else {}
    model = _model(args.model)
    loader = _loader(32, args.steps)
    t0 = time.perf_counter()
    res = torchspeed.fit(model, loader, epochs=1, max_steps=args.steps, lr=0.05, schedule="onecycle", progress=False,
                         compile=False, callbacks=[StopWhenDecided()], **kw)
    sec = time.perf_counter() - t0
    d = res.decisions
    trial = d.get("switch_trial")
    label = f"{d['precision'].value}" + ("+channels_last" if d["channels_last"].value else "")
    measured = (trial.measured or {}) if trial is not None else {}
    stage = next(iter(measured.get("stages") or []), {})
    print("RESULT " + json.dumps({"seconds": sec, "steps": res.steps, "setting": label,
                                  "trial": None if trial is None else trial.value,
                                  "trial_steps": None if trial is None else (trial.measured or {}).get("steps"),
                                  "pool_runs": (measured.get("pool") or {}).get("runs"),
                                  "why": stage.get("why"), "seconds_per_step": stage.get("seconds_per_step"),
                                  "dropped": measured.get("dropped"), "pool": measured.get("pool")}))


def run(tree: str, model: str, steps: int, cache: str, *, fixed: dict | None = None, stop: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(HERE)]), TORCHSPEED_CACHE_DIR=cache)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", model, "--steps", str(steps)]
    cmd += ["--fixed", json.dumps(fixed)] if fixed else []
    cmd += ["--stop-after-trial"] if stop else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model}: the run failed:\n{out.stderr[-2000:]}")
    return json.loads(line[7:])


def truth(tree: str, model: str, steps: int, rounds: int, settings: dict) -> dict:
    times: dict[str, list[float]] = {k: [] for k in settings}
    for r in range(rounds):
        for k in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
            times[k].append(run(tree, model, steps, tempfile.mkdtemp(prefix="pool-truth-"), fixed=settings[k])
                            ["seconds"])
            print(f"  truth {model} round {r + 1}: {k:20s} {times[k][-1]:.2f} s", flush=True)
    return {"seconds": times, "median_s": {k: statistics.median(v) for k, v in times.items()}}


def sequences(trees: list[str], model: str, steps: int, n_seq: int, n_runs: int) -> list[dict]:
    out = []
    for s in range(n_seq):
        caches = {t: tempfile.mkdtemp(prefix="pool-seq-") for t in trees}
        runs: dict[str, list[dict]] = {t: [] for t in trees}
        for i in range(n_runs):
            order = trees if (s + i) % 2 == 0 else trees[::-1]
            for t in order:
                runs[t].append(run(t, model, steps, caches[t], stop=True))
                r = runs[t][-1]
                print(f"  seq {s + 1} run {i + 1} {Path(t).parent.name:10s}: {r['setting']:20s} {r['trial']} "
                      f"({r['trial_steps']} trial steps, pool {r['pool_runs']})", flush=True)
        out.append({t: runs[t] for t in trees})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--fixed", default="")
    ap.add_argument("--stop-after-trial", action="store_true")
    ap.add_argument("--trees", nargs="+", help="source folders: the baseline first")
    ap.add_argument("--models", nargs="+", default=["resnet18", "timm:mobilenetv3_small_050"])
    ap.add_argument("--run-steps", type=int, default=400)
    ap.add_argument("--truth-steps", type=int, default=200)
    ap.add_argument("--truth-rounds", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cpu/trial_pool.json")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    sys.path.insert(0, args.trees[-1])
    sys.path.insert(0, str(HERE))
    from bench_switches import manual_settings
    from torchspeed.bench.runner import provenance
    settings = manual_settings()
    results = {}
    for model in args.models:
        tr = truth(args.trees[-1], model, args.truth_steps, args.truth_rounds, settings)
        seqs = sequences(args.trees, model, args.run_steps, args.sequences, args.runs)
        best = min(tr["median_s"], key=tr["median_s"].get)
        summary = {}
        for t in args.trees:
            settled = [seq[t][-1]["setting"] for seq in seqs]
            ratio = [tr["median_s"][x] / tr["median_s"][best] for x in settled]
            summary[t] = {"settled": settled, "settled_over_best": ratio,
                          "mean_settled_over_best": statistics.fmean(ratio),
                          "trial_steps_per_run": [[r["trial_steps"] for r in seq[t]] for seq in seqs]}
            print(f"{model}: {Path(t).parent.name}: settled {settled}, {statistics.fmean(ratio):.3f}x the best's "
                  f"time ({best})", flush=True)
        results[model] = {"truth": tr, "best": best, "sequences": seqs, "summary": summary}
    out = {"claim": __doc__.splitlines()[0], "command": " ".join(sys.argv), "trees": args.trees, "results": results,
           "meta": provenance()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
