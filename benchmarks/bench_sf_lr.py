"""Claim: Schedule-Free AdamW's prior LR (`train.optim.schedule_free_lr`) is near the fastest fixed LR, per model class.

When `fit(recipe="auto")` takes Schedule-Free AdamW without measuring (a run too short to afford a trial), the
LR is a rule of the model's width: the default 0.0025 x a reference fan-in / the weights' typical fan-in. This
bench times Schedule-Free AdamW through `fit`, cold, at a grid of LRs (0.0025 x 1, 4, 8, 16) and at the rule's
LR, to a target on each model, 2 seeds:

- the suite's six workloads (`torchspeed.bench.suite`; the suite's own targets and budgets, the
  `schedulefree` row with its LR replaced);
- models the suite does not have, on data that ships offline: a narrow CNN (8 channels) and a 64-wide MLP on
  scikit-learn's 8x8 digits, a 2-layer GRU classifying token sequences by their first token, and a 64-wide
  ViT (2 layers, LayerNorm, attention) on the digits' 2x2 patches; and a deep one, ResNet-20 (22 weight layers,
  BatchNorm) on the digits at 32 px (the bench's time-to-accuracy workload).

Per model: seconds and steps to the target at each LR (`null`: missed in the budget), the rule's LR and class
(attention/LayerNorm or not), and the rule's seconds against the fastest grid LR's.

Run:
    python benchmarks/bench_sf_lr.py --out benchmarks/results/cpu-avx512-bf16/sf_lr.json
    python benchmarks/bench_sf_lr.py --models cnn1d,char_lm,gru2 --grid 16,24,32 --out ...  # above the 16x cap
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.bench import suite, suite_run
from torchspeed.bench.runner import provenance
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.optim import SCHEDULE_FREE_LR, has_attention, schedule_free_lr, typical_fan_in

GRID = (1, 4, 8, 16)  # x Schedule-Free AdamW's default LR
SEEDS = (0, 1)


class NarrowCNN(nn.Module):
    def __init__(self, w: int = 8):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
                               nn.MaxPool2d(2), nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, 10))

    def forward(self, x):
        return self.f(x)


class MLP64(nn.Module):
    def __init__(self, w: int = 64):
        super().__init__()
        self.f = nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))

    def forward(self, x):
        return self.f(x)


class GRU2(nn.Module):
    def __init__(self, h: int = 96):
        super().__init__()
        self.e, self.rnn, self.o = nn.Embedding(10, 24), nn.GRU(24, h, batch_first=True, num_layers=2), nn.Linear(h, 4)

    def forward(self, x):
        return self.o(self.rnn(self.e(x))[0][:, -1])


class TinyViT(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.p, self.pos = nn.Linear(4, d), nn.Parameter(torch.zeros(16, d))
        self.t = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True), 2)
        self.o = nn.Linear(d, 10)

    def forward(self, x):
        x = x.view(-1, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(-1, 16, 4)
        return self.o(self.t(self.p(x) + self.pos).mean(1))


def _digits():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16, torch.tensor(y)
    p = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[p[:1400]], y[p[:1400]], x[p[1400:]], y[p[1400:]]


def _first_token(n: int = 4000, t: int = 30):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 10, (n + 1000, t), generator=g)
    y = x[:, 0] % 4  # the class is the first token's, read at the end of the sequence
    return x[:n], y[:n], x[n:], y[n:]


def _digits32():
    from torchspeed.bench.workloads import digits
    train, val = digits()
    return (*train.tensors, *val.tensors)


def _resnet20():
    from torchspeed.bench.workloads import resnet20
    return resnet20()


# name: (model, data, batch, epochs, target val_acc)
HELD_OUT = {"narrow_cnn": (NarrowCNN, _digits, 32, 8, 0.9), "mlp64": (MLP64, _digits, 32, 8, 0.97),
            "gru2": (GRU2, _first_token, 64, 6, 0.9), "tiny_vit": (TinyViT, _digits, 32, 8, 0.9),
            "resnet20": (_resnet20, _digits32, 64, 4, 0.97)}


class StopAt(Callback):
    def __init__(self, target: float, t0: float):
        self.target, self.t0, self.at, self.step = target, t0, None, None

    def on_evaluate(self, trainer, metrics):
        if self.at is None and metrics.get("val_acc", 0.0) >= self.target:
            self.at, self.step = time.perf_counter() - self.t0, trainer.step
            trainer.request_stop("target")


def held_out_run(name: str, lr: float, seed: int) -> dict:
    build, data, batch, epochs, target = HELD_OUT[name]
    x, y, vx, vy = data()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHSPEED_CACHE_DIR"] = cache
        torch.manual_seed(seed)
        model = build()
        train = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True,
                           generator=torch.Generator().manual_seed(seed))
        t0 = time.perf_counter()
        stop = StopAt(target, t0)
        res = torchspeed.fit(model, train, epochs=epochs, val_loader=DataLoader(TensorDataset(vx, vy), batch_size=500),
                             optimizer="schedulefree", lr=lr, progress=False, callbacks=[stop], restore_best=False)
    return {"to_target_s": stop.at, "steps": stop.step if stop.at else res.steps, "reached": stop.at is not None,
            "metric": res.history[-1].get("val_acc") if res.history else None}


def suite_run_at(workload, data, lr: float, seed: int) -> dict:
    suite_run.SCHEDULE_FREE_LR = lr  # the schedulefree row's LR
    r = suite_run.run_row(workload, "schedulefree", seed, data)
    return {"to_target_s": r["to_target_s"], "steps": r["steps_to_target"] or r["steps_trained"], "reached": r["reached"],
            "metric": r["metric"]}


def _median(runs: list[dict]) -> float | None:
    if not all(r["reached"] for r in runs):
        return None
    return statistics.median(r["to_target_s"] for r in runs)


def measure(name: str, model: nn.Module, run, grid=GRID) -> dict:
    rule_lr, why = schedule_free_lr(model)
    lrs = sorted({round(SCHEDULE_FREE_LR * k, 6) for k in grid} | {round(rule_lr, 6)})
    run(lrs[0], SEEDS[0])  # warm-up: first-call set-up, untimed
    per_lr = {}
    for lr in lrs:
        runs = [run(lr, seed) for seed in SEEDS]
        per_lr[str(lr)] = {"runs": runs, "median_s": _median(runs)}
    reached = {lr: v["median_s"] for lr, v in per_lr.items() if v["median_s"] is not None}
    best = min(reached, key=reached.get) if reached else None
    rule = per_lr[str(round(rule_lr, 6))]["median_s"]
    out = {"fan_in": typical_fan_in(model), "attention": has_attention(model), "rule_lr": rule_lr, "rule_why": why,
           "per_lr": per_lr, "best_lr": best,
           "rule_vs_best": None if rule is None or best is None else round(reached[best] / rule, 3)}
    cells = ", ".join(f"{lr}: " + ("missed" if v["median_s"] is None else f"{v['median_s']:.2f} s")
                      for lr, v in per_lr.items())
    print(f"{name}: fan-in {out['fan_in']}, attention {out['attention']}, rule {rule_lr:g}; {cells}; "
          f"rule vs best {out['rule_vs_best']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=None, help="comma-separated subset (suite workloads and held-out models)")
    ap.add_argument("--out", default="benchmarks/results/cpu/sf_lr.json")
    ap.add_argument("--grid", default=",".join(map(str, GRID)), help="the LRs, as multiples of the default 0.0025")
    args = ap.parse_args()
    grid = tuple(float(k) for k in args.grid.split(","))
    logging.getLogger("torchspeed").setLevel(logging.ERROR)
    wanted = set(args.models.split(",")) if args.models else None
    t0 = time.perf_counter()
    result: dict = {"kind": "schedule_free_prior_lr", "grid": [SCHEDULE_FREE_LR * k for k in grid], "seeds": SEEDS,
                    "models": {}}
    for w in suite.suite_workloads():
        if wanted is None or w.name in wanted:
            data = suite.load_data(w)
            result["models"][w.name] = measure(w.name, w.model(), lambda lr, s, w=w, d=data: suite_run_at(w, d, lr, s),
                                               grid)
    for name, (build, *_rest) in HELD_OUT.items():
        if wanted is None or name in wanted:
            result["models"][name] = measure(name, build(), lambda lr, s, n=name: held_out_run(n, lr, s), grid)
    result["seconds"] = time.perf_counter() - t0
    result["provenance"] = provenance()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
