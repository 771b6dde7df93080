"""Claim to test: a batch-size warm-up (BatchRamp, T17) reaches the same accuracy in fewer steps; is it sooner?

ResNet-20 on the digits with `torchspeed.fit` (every speed switch on auto, one-cycle, SGD),
the same number of epochs (so the same samples) for each row, on several seeds:

- `fixed`: batch 64 throughout, peak LR 0.1 (the bench's recipe);
- `ramp`: batches growing from `--start` (32) to `--end` (128) over the first half of the
  run's samples (`BatchRamp`), peak LR 0.1 x end / 64 (the linear rule; fit scales it to
  each batch).

Rows and seeds are interleaved (seed 0: fixed, ramp; seed 1: fixed, ramp; ...). Reported per
row: optimizer steps, wall time of `fit` (the switch trial is cached after the first run),
final validation accuracy; and the per-seed time ratio fixed/ramp with its median.

Run:
    python benchmarks/bench_batch_ramp.py --seeds 3 --epochs 4 [--start 32 --end 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, RandomSampler

import torchspeed
from torchspeed.bench.runner import provenance
from torchspeed.bench.workloads import create_model, digits
from torchspeed.train import BatchRamp


def run(kind: str, seed: int, epochs: int, train, val, *, start: int = 32, end: int = 128) -> dict:
    torch.manual_seed(seed)
    model = create_model("resnet20", num_classes=10)
    g = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        loader, lr = DataLoader(train, batch_size=64, shuffle=True, generator=g, drop_last=True), 0.1
    else:
        ramp = BatchRamp(RandomSampler(train, generator=g), start=start, end=end,
                         ramp_samples=epochs * len(train) // 2, drop_last=True)
        loader, lr = DataLoader(train, batch_sampler=ramp), 0.1 * end / 64  # the linear rule from 0.1 at 64
    val_loader = DataLoader(val, batch_size=256)
    t0 = time.perf_counter()
    res = torchspeed.fit(model, loader, epochs=epochs, lr=lr, val_loader=val_loader, progress=False,
                         schedule="onecycle")
    seconds = time.perf_counter() - t0
    return {"row": kind, "seed": seed, "steps": res.steps, "seconds": seconds,
            "samples": sum(r.get("samples", 0) for r in res.history) or None,
            "val_acc": res.history[-1]["val_acc"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--start", type=int, default=32)
    ap.add_argument("--end", type=int, default=128)
    ap.add_argument("--json", default="benchmarks/results/cpu/batch_ramp.json")
    args = ap.parse_args()
    train, val = digits()
    run("fixed", 99, 1, train, val)  # warm-up: the switch trial runs (and is cached) here, off the record
    rows = []
    for s in range(args.seeds):
        for kind in ("fixed", "ramp"):
            rows.append(run(kind, s, args.epochs, train, val, start=args.start, end=args.end))
            print(rows[-1], flush=True)
    by = {k: [r for r in rows if r["row"] == k] for k in ("fixed", "ramp")}
    ratios = [f["seconds"] / r["seconds"] for f, r in zip(by["fixed"], by["ramp"])]
    summary = {k: {"steps": statistics.median(r["steps"] for r in v),
                   "seconds": statistics.median(r["seconds"] for r in v),
                   "val_acc": [round(r["val_acc"], 4) for r in v]} for k, v in by.items()}
    summary["time_fixed_over_ramp"] = {"median": statistics.median(ratios), "per_seed": ratios}
    out = {"meta": provenance() | {"epochs": args.epochs, "seeds": args.seeds, "start": args.start, "end": args.end}, "rows": rows, "summary": summary}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
