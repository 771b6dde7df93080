"""Does the LR range test (T15) land within 2x of the best LR of a sweep?

Claim: the peak LR that `fit(lr="auto")` trains with (the one-cycle `max_lr` of `find_lr`,
through the plan's `tune_lr` stage, the user's optimizer and precision) is within a factor 2 of the
best peak LR of a sweep with the same budget, on each workload below.

Method, per workload and seed: build the model from the seed, run `make_plan(lr="auto")` (the plan's tuner stages)
on the training loader (what `fit` does first) and keep its LR and its `lr_find` decision
(confidence, rule, and the fallback trial's table when it ran). The sweep: peak LRs a
factor 2 apart around that LR (7 values, extended by one on a side while the best is at
that edge, up to 3 times), each trained by `fit` from the same initial weights and batch
order with the same budget (one-cycle over `--steps` optimizer steps), scored by the
validation loss at the end. The best sweep LR is the one with the lowest validation loss
averaged over the seeds; the ratio is the range test's LR (per seed) over it. The same ratio
is reported for the peak `fit(recipe="auto")` trains with (`recipe`: the range test, then the
recipe's short one-cycle trial of 1x, 2x and 4x its pick; the recipe's "lr" stage, plan/recipe_lr.py).

Workloads (all small enough for 2 CPU cores):
- resnet20: ResNet-20 on the digits (32 px, batch 64), SGD momentum 0.9, wd 5e-4.
- cnn: a small CNN without BatchNorm (3 conv layers + linear) on the digits (16 px, batch
  64), SGD momentum 0.9, wd 5e-4.
- transformer: a 2-layer GPT (d=64, 4 heads, 64-byte context) on the `text` bytes (batch
  32), AdamW (wd 0.05).
- mlp: the bench MLP on the digits (16 px, batch 64), SGD momentum 0.9.

Results (per workload: per LR and seed, the range test's LR per seed, the ratio) go to
benchmarks/results/cpu/lr_sweep.json with provenance (commit, versions, device, CPU flags).

    python benchmarks/bench_lr_sweep.py [--workloads resnet20,cnn,transformer,mlp] [--seeds 2]
                                        [--steps N] [--precision auto] [--no-fallback] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import torchspeed
from torchspeed._io import write_json
from torchspeed.bench.runner import provenance
from torchspeed.bench.text import GPT, byte_text_datasets
from torchspeed.bench.workloads import create_model, digits
from torchspeed.env import other_runnable
from torchspeed.train.evaluate import evaluate
from torchspeed.train.trial.precision import resolve_precision
from torchspeed.plan import make_plan
from torchspeed.train.config import TrainConfig

OUT = Path(__file__).resolve().parent / "results" / "cpu" / "lr_sweep.json"


def small_cnn(num_classes: int = 10) -> nn.Module:
    """3 conv layers (16/32/64 channels, ReLU, max-pool) and a linear head; no BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, num_classes))


STEPS = {"resnet20": 48, "cnn": 120, "transformer": 120, "mlp": 48}  # one-cycle budget per sweep run


def workload(name: str):
    """(make_model, train set, val set, batch size, optimizer name, description)."""
    if name == "resnet20":
        train, val = digits(size=32)
        return lambda: create_model("resnet20"), train, val, 64, "sgd", "ResNet-20, digits 32 px, SGD m0.9 wd 5e-4"
    if name == "cnn":
        train, val = digits(size=16)
        return small_cnn, train, val, 64, "sgd", "3-conv CNN (no BN), digits 16 px, SGD m0.9 wd 5e-4"
    if name == "transformer":
        train, val = byte_text_datasets(train_size=2048, val_size=256, block_size=64)
        return (lambda: GPT(n_layer=2, n_head=4, n_embd=64, block_size=64), train, val, 32, "adamw",
                "GPT 2 layers d=64, text bytes (64-byte context), AdamW wd 0.05")
    if name == "mlp":
        train, val = digits(size=16)
        return lambda: create_model("mlp", image_size=16), train, val, 64, "sgd", "MLP, digits 16 px, SGD m0.9"
    raise ValueError(f"workload {name!r} is not one of resnet20, cnn, transformer, mlp")


def _model(make, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make()


def _loader(train, batch: int, seed: int) -> DataLoader:
    return DataLoader(train, batch_size=batch, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(seed))


def range_test_lr(make, train, batch: int, opt: str, seed: int, precision: str, fallback: bool) -> dict:
    """The peak LR fit(lr="auto") would train with (the plan's `tune_lr` stage), its decision, and the curve."""
    import torchspeed.tune.lr as lr_module

    model = _model(make, seed)
    seen = []
    find_lr = lr_module.find_lr

    def recording(*args, **kwargs):  # the LR tuner imports find_lr when called: record what it returns
        res = find_lr(*args, **{**kwargs, "fallback": fallback})
        seen.append(res)
        return res

    lr_module.find_lr = recording
    t0 = time.perf_counter()
    try:
        plan = make_plan(model, _loader(train, batch, seed), TrainConfig(precision=precision, schedule="onecycle",
                                                                         distributed=False, progress=False),
                         lr="auto", optimizer=opt, device="cpu")
        lr, decisions = plan.lr, plan.decisions
    finally:
        lr_module.find_lr = find_lr
    res = seen[0].to_dict()
    keep = ("suggestion", "steepest_lr", "valley_lr", "min_loss_lr", "max_lr", "min_lr", "confidence", "trial",
            "steps", "diverged", "lrs", "losses")
    return {"lr": lr, "decision": decisions["lr_find"], "seconds": time.perf_counter() - t0,
            "result": {k: res[k] for k in keep if k in res}}


def recipe_lr(make, train, batch: int, opt: str, seed: int, precision: str) -> dict:
    """The peak LR fit(recipe="auto") trains with: the range test, then its short one-cycle trial (the recipe's "lr"
    stage, plan/recipe_lr.py), measured before the run with nothing cached and every part affordable."""
    import tempfile

    from torchspeed.plan import budget, make_plan
    from torchspeed.train.config import TrainConfig
    from torchspeed.train.decision import TrialCache

    model = _model(make, seed)
    t0 = time.perf_counter()
    share, budget.TUNING_SHARE = budget.TUNING_SHARE, 1e9  # no budget: the LR part measures whatever the run
    try:
        rec = make_plan(model, _loader(train, batch, seed), TrainConfig(precision=precision, trial=False,
                                                                        progress=False, compile=False),
                        optimizer=opt, device="cpu", recipe="auto", recipe_parts=("lr",),
                        cache=TrialCache(Path(tempfile.mkdtemp()) / "trials.json")).recipe
    finally:
        budget.TUNING_SHARE = share
    return {"lr": rec.lr, "decision": str(rec.decisions["lr"]), "seconds": time.perf_counter() - t0,
            "measured": rec.decisions["lr"].measured}


def train_score(make, train, val, batch: int, opt: str, seed: int, lr: float, steps: int, precision: str) -> dict:
    model = _model(make, seed)
    loader = _loader(train, batch, seed)
    epochs = math.ceil(steps / len(loader))
    torchspeed.fit(model, loader, optimizer=opt, lr=lr, epochs=epochs, max_steps=steps, schedule="onecycle",
                   precision=precision, compile=False, trial=False, channels_last=False, restore_best=False,
                   progress=False, seed=seed, device="cpu")
    m = evaluate(model, DataLoader(val, batch_size=256), device="cpu")
    loss = m["val_loss"] if math.isfinite(m["val_loss"]) else math.inf
    return {"val_loss": loss, "val_acc": m.get("val_acc")}


def run_workload(name: str, *, seeds: list[int], steps: int, precision: str, fallback: bool, width: int,
                 previous: dict | None = None) -> dict:
    make, train, val, batch, opt, desc = workload(name)
    tests = {s: range_test_lr(make, train, batch, opt, s, precision, fallback) for s in seeds}
    for s, t in tests.items():
        print(f"[{name}] seed {s}: range test lr {t['lr']:.3g} ({t['seconds']:.0f} s): {t['decision']}", flush=True)
    recipes = {s: recipe_lr(make, train, batch, opt, s, precision) for s in seeds}
    for s, t in recipes.items():
        print(f"[{name}] seed {s}: recipe lr {t['lr']:.3g} ({t['seconds']:.0f} s)", flush=True)
    centre = math.exp(statistics.mean(math.log(t["lr"]) for t in tests.values()))
    runs: dict[float, dict[int, dict]] = {}

    def sweep(lr: float) -> None:
        runs[lr] = {s: train_score(make, train, val, batch, opt, s, lr, steps, precision) for s in seeds}
        print(f"[{name}] lr {lr:.3g}: val_loss " + ", ".join(f"{r['val_loss']:.4f}" for r in runs[lr].values()),
              flush=True)

    if previous is not None:  # the sweep does not depend on the range test: reuse it, extend it if need be
        if previous["steps"] != steps or sorted(previous["sweep"][0]["per_seed"]) != sorted(map(str, seeds)):
            raise SystemExit(f"--sweep-from: {name}'s sweep used other steps or seeds")
        runs = {row["lr"]: {int(s): r for s, r in row["per_seed"].items()} for row in previous["sweep"]}
    else:
        for k in range(-(width // 2), width - width // 2):
            sweep(centre * 2.0 ** k)

    def mean_loss(lr):
        return statistics.mean(r["val_loss"] for r in runs[lr].values())

    for _ in range(3):  # extend while the best is at an edge of the sweep
        lrs = sorted(runs)
        best = min(lrs, key=mean_loss)
        if best == lrs[0]:
            sweep(lrs[0] / 2)
        elif best == lrs[-1]:
            sweep(lrs[-1] * 2)
        else:
            break
    lrs = sorted(runs)
    best = min(lrs, key=mean_loss)
    ratios = {s: t["lr"] / best for s, t in tests.items()}
    within = all(0.5 <= r <= 2.0 for r in ratios.values())
    recipe_ratios = {s: t["lr"] / best for s, t in recipes.items()}
    print(f"[{name}] recipe / best: " + ", ".join(f"{r:.2f}" for r in recipe_ratios.values())
          + f" -> within 2x: {all(0.5 <= r <= 2.0 for r in recipe_ratios.values())}", flush=True)
    print(f"[{name}] best sweep lr {best:.3g} (val_loss {mean_loss(best):.4f}); range test / best: "
          + ", ".join(f"{r:.2f}" for r in ratios.values()) + f" -> within 2x: {within}", flush=True)
    return {"description": desc, "batch_size": batch, "optimizer": opt, "steps": steps,
            "range_test": {str(s): t for s, t in tests.items()},
            "sweep": [{"lr": lr, "mean_val_loss": mean_loss(lr), "per_seed": {str(s): r for s, r in runs[lr].items()}}
                      for lr in lrs],
            "best_lr": best, "best_at_edge": best in (lrs[0], lrs[-1]),
            "ratio_per_seed": {str(s): r for s, r in ratios.items()}, "within_2x": within,
            "recipe": {str(s): t for s, t in recipes.items()},
            "recipe_ratio_per_seed": {str(s): r for s, r in recipe_ratios.items()},
            "recipe_within_2x": all(0.5 <= r <= 2.0 for r in recipe_ratios.values()),
            "sweep_reused": previous is not None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="resnet20,cnn,transformer,mlp")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help=f"optimizer steps per sweep run, one-cycle over them (default per workload: {STEPS})")
    ap.add_argument("--width", type=int, default=7, help="LRs in the sweep before edge extension")
    ap.add_argument("--precision", default="auto", help="as fit's precision; 'auto' is resolved once for the device")
    ap.add_argument("--no-fallback", action="store_true", help="the range test without its measured fallback")
    ap.add_argument("--quick", action="store_true", help="1 seed, 5 LRs, half the steps")
    ap.add_argument("--sweep-from", default=None,
                    help="a previous result JSON: reuse its sweeps (same steps and seeds), rerun only the range tests")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    seeds = list(range(1 if args.quick else args.seeds))
    width = 5 if args.quick else args.width
    precision = resolve_precision(args.precision, device="cpu").name
    reused = json.loads(Path(args.sweep_from).read_text()) if args.sweep_from else {"results": {}, "meta": None}
    previous = reused["results"]
    load_before = other_runnable()
    t0 = time.perf_counter()
    results = {w: run_workload(w, seeds=seeds, steps=args.steps or STEPS[w] // (2 if args.quick else 1),
                               precision=precision, fallback=not args.no_fallback, width=width,
                               previous=previous.get(w))
               for w in args.workloads.split(",")}
    meta = provenance() | {"precision": precision, "seeds": seeds, "sweep_factor": 2, "width": width,
                           "fallback": not args.no_fallback, "seconds": time.perf_counter() - t0,
                           "sweeps_reused_from": reused["meta"],
                           "other_runnable_before": load_before, "other_runnable_after": other_runnable()}
    write_json(args.out, {"meta": meta, "results": results})
    print(f"wrote {args.out} ({meta['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
