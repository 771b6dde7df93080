"""Claim: `fit`'s own cost per training step is small against a plain loop's, measured where it shows most.

A tiny model (`Linear(8, 2)`, batch 100, 4,000 samples held in memory) makes the step about as cheap as a
step gets, so what a trainer does around the step is most of the difference. Two readings, each the best of
`--repeats` interleaved passes (the machine's noise only ever adds time):

- **step**: one batch, `Trainer.train_step` against the plain step (`loss = F.cross_entropy(model(x), y);
  zero_grad; backward; step`) on the same model and optimizer (fused AdamW), in microseconds per step;
- **epoch**: one pass over the shuffled data, the Trainer's own epoch loop (index slices, its guard, meter
  and bookkeeping) against the plain loop's `randperm` and slices.

The Trainer is the one `fit(..., val_loader=...)` builds (the loss read as on this device; `train_acc` left
to the validation set). Nothing is asserted: the JSON records microseconds per step and the difference.

Run:
    python benchmarks/bench_step_cost.py --out benchmarks/results/cpu/step_cost.json
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.bench.runner import provenance
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.in_memory import sliced_loader
from torchspeed.train.loop.progress import TrainProgress

N, BATCH = 4000, 100


class _Grab(Callback):
    def on_train_start(self, trainer):
        self.trainer = trainer


def _trainer(x, y):
    grab = _Grab()
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    val = DataLoader(TensorDataset(x[:200], y[:200]), batch_size=BATCH)
    model = torch.nn.Linear(x.shape[1], 2)
    torchspeed.fit(model, train, epochs=1, val_loader=val, progress=False, optimizer="adamw", lr=1e-2,
                   weight_decay=0.0, precision="fp32", fused_optimizer=True, compile=False, callbacks=[grab])
    return grab.trainer, model, sliced_loader(train, torch.device("cpu"))


def measure(repeats: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(N, 8)
    y = (x[:, 0] > 0).long()
    t, model, sliced = _trainer(x, y)
    opt, batch, steps = t.optimizer, (x[:BATCH], y[:BATCH]), N // BATCH
    progress = TrainProgress(enabled=False, total=None)

    def plain_step():
        loss = F.cross_entropy(model(batch[0]), batch[1])
        opt.zero_grad()
        loss.backward()
        opt.step()

    def plain_epoch():
        perm = torch.randperm(N)
        for i in range(0, N, BATCH):
            idx = perm[i:i + BATCH]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()

    def per_step(fn, number: int) -> float:
        fn()
        return 1e6 * min(timeit.repeat(fn, number=number, repeat=1)) / number

    rows: dict[str, list[float]] = {"plain_step": [], "trainer_step": [], "plain_epoch": [], "trainer_epoch": []}
    for _ in range(repeats):  # interleaved: a slow phase of the machine hits every reading alike
        rows["plain_step"].append(per_step(plain_step, 500))
        rows["trainer_step"].append(per_step(lambda: t.train_step(batch), 500))
        rows["plain_epoch"].append(per_step(plain_epoch, 5) / steps)
        rows["trainer_epoch"].append(per_step(lambda: t._train_epoch(sliced, 0, 0, progress), 5) / steps)
    best = {k: round(min(v), 1) for k, v in rows.items()}
    return {"us_per_step": best, "samples_us": rows,
            "step_overhead_us": round(best["trainer_step"] - best["plain_step"], 1),
            "epoch_overhead_us": round(best["trainer_epoch"] - best["plain_epoch"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/cpu/step_cost.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = measure(args.repeats)
    b = result["us_per_step"]
    print(f"step: plain {b['plain_step']} us, Trainer {b['trainer_step']} us (+{result['step_overhead_us']}); "
          f"epoch: plain {b['plain_epoch']} us/step, Trainer {b['trainer_epoch']} us/step "
          f"(+{result['epoch_overhead_us']})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kind": "step_cost", "model": "Linear(8, 2)", "batch_size": BATCH, "samples": N,
                               **result, "seconds": round(time.perf_counter() - t0, 1),
                               "provenance": provenance()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
