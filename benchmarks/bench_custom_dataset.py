"""Claim: a Dataset of your own that only indexes its tensors trains under `fit` faster than the script's own loop
over a DataLoader of it (the per-sample collate is gone: `train/in_memory.plain_fields`).

The 1D CNN of `torchspeed.bench.small` (`cnn1d`: 4,000 waveforms held in memory, batch 100, Adam at 1e-2, 10
epochs, an evaluation of the 1,000 held-out samples after each), its data behind the three-method Dataset a
script writes (`__len__`, and `__getitem__` returning `self.x[i], self.y[i]`):

- `script`: the loop over `DataLoader(Waves(x, y), batch_size=100, shuffle=True)`;
- `fit`: `fit(model, the same loader, optimizer="adam", lr=1e-2, val_loader=DataLoader(Waves(vx, vy)))`, cold.

Whole runs, interleaved in `--rounds` rounds after a warm-up; fit's speed = script seconds / fit seconds.

Run:
    python benchmarks/bench_custom_dataset.py --out benchmarks/results/cpu-avx512-bf16/custom_dataset.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import torchspeed
from torchspeed.bench.runner import provenance
from torchspeed.bench.small import make_small, plain_loop
from torchspeed.train.rounds import ratio_summary


class Waves(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def script(w, epochs: int) -> float:
    """The script's loop (`plain_loop`: Adam at the workload's LR, an evaluation after each epoch) over its
    DataLoader of `Waves`."""
    torch.manual_seed(0)
    model = w.model()
    loader = DataLoader(Waves(w.x, w.y), batch_size=w.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return plain_loop(model, w, epochs=epochs, loader=loader)["seconds"]


def fit(w, epochs: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHSPEED_CACHE_DIR"] = cache
        torch.manual_seed(0)
        model = w.model()
        loader = DataLoader(Waves(w.x, w.y), batch_size=w.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        res = torchspeed.fit(model, loader, epochs=epochs, val_loader=DataLoader(Waves(w.vx, w.vy), batch_size=500),
                             optimizer="adam", lr=w.lr, progress=False)
        return time.perf_counter() - t0, {k: str(d.value) for k, d in res.decisions.items()
                                          if k in ("batching", "precision", "optimizer")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/cpu/custom_dataset.json")
    args = ap.parse_args()
    w = make_small("cnn1d")
    script(w, 1), fit(w, 1)  # warm-up
    secs: dict[str, list[float]] = {"script": [], "fit": []}
    decisions: dict = {}
    for r in range(args.rounds):
        for k in (("script", "fit") if r % 2 == 0 else ("fit", "script")):
            if k == "script":
                secs[k].append(script(w, args.epochs))
            else:
                t, decisions = fit(w, args.epochs)
                secs[k].append(t)
    speed = ratio_summary([a / b for a, b in zip(secs["script"], secs["fit"])])
    out = {"kind": "custom_dataset_whole_run", "workload": "cnn1d", "epochs": args.epochs, "seconds": secs,
           "fit_speed_vs_script": speed, "fit_decisions": decisions, "provenance": provenance()}
    print(f"script {min(secs['script']):.3f} s, fit {min(secs['fit']):.3f} s (fastest); fit's speed {speed}; "
          f"batching: {decisions.get('batching')}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
