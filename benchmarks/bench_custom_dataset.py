"""Claim: a Dataset of your own that only indexes its tensors trains under `fit` faster than the script's own loop
over a DataLoader of it (the per-sample collate is gone: `train/in_memory.plain_fields`), whether its samples are
tuples or dicts (`--form dict`: `{"x": self.x[i], "y": self.y[i]}`, Hugging Face style).

The 1D CNN of `torchspeed.bench.small` (`cnn1d`: 4,000 waveforms held in memory, batch 100, Adam at 1e-2, 10
epochs, an evaluation of the 1,000 held-out samples after each), its data behind the three-method Dataset a
script writes (`__len__`, and `__getitem__` returning `self.x[i], self.y[i]`):

- `script`: the loop over `DataLoader(Waves(x, y), batch_size=100, shuffle=True)` (for dicts, each batch read as
  `batch["x"], batch["y"]`);
- `fit`: `fit(model, the same loader, optimizer="adam", lr=1e-2, val_loader=DataLoader(Waves(vx, vy)))`, cold.

Whole runs, interleaved in `--rounds` rounds after a warm-up; fit's speed = script seconds / fit seconds.

Run:
    python benchmarks/bench_custom_dataset.py --out benchmarks/results/cpu-avx512-bf16/custom_dataset.json
    python benchmarks/bench_custom_dataset.py --form dict --out benchmarks/results/cpu-amx/custom_dataset_dict.json
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


class Records(Waves):
    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class _Pairs:
    """A script's `for batch in loader: x, y = batch["x"], batch["y"]`, as the (x, y) loop `plain_loop` runs."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return ((b["x"], b["y"]) for b in self.loader)


FORMS = {"tuple": Waves, "dict": Records}


def script(w, epochs: int, form: str = "tuple") -> float:
    """The script's loop (`plain_loop`: Adam at the workload's LR, an evaluation after each epoch) over its
    DataLoader of `Waves` (or `Records`)."""
    torch.manual_seed(0)
    model = w.model()
    loader = DataLoader(FORMS[form](w.x, w.y), batch_size=w.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return plain_loop(model, w, epochs=epochs, loader=loader if form == "tuple" else _Pairs(loader))["seconds"]


def fit(w, epochs: int, form: str = "tuple") -> tuple[float, dict]:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCHSPEED_CACHE_DIR"] = cache
        torch.manual_seed(0)
        model = w.model()
        kind = FORMS[form]
        loader = DataLoader(kind(w.x, w.y), batch_size=w.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        res = torchspeed.fit(model, loader, epochs=epochs, val_loader=DataLoader(kind(w.vx, w.vy), batch_size=500),
                             optimizer="adam", lr=w.lr, progress=False)
        return time.perf_counter() - t0, {k: str(d.value) for k, d in res.decisions.items()
                                          if k in ("batching", "precision", "optimizer")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--form", choices=tuple(FORMS), default="tuple", help="the samples: tuples or dicts")
    ap.add_argument("--out", default="benchmarks/results/cpu/custom_dataset.json")
    args = ap.parse_args()
    w = make_small("cnn1d")
    script(w, 1, args.form), fit(w, 1, args.form)  # warm-up
    secs: dict[str, list[float]] = {"script": [], "fit": []}
    decisions: dict = {}
    for r in range(args.rounds):
        for k in (("script", "fit") if r % 2 == 0 else ("fit", "script")):
            if k == "script":
                secs[k].append(script(w, args.epochs, args.form))
            else:
                t, decisions = fit(w, args.epochs, args.form)
                secs[k].append(t)
    speed = ratio_summary([a / b for a, b in zip(secs["script"], secs["fit"])])
    out = {"kind": "custom_dataset_whole_run", "workload": "cnn1d", "form": args.form, "epochs": args.epochs,
           "seconds": secs,
           "fit_speed_vs_script": speed, "fit_decisions": decisions, "provenance": provenance()}
    print(f"script {min(secs['script']):.3f} s, fit {min(secs['fit']):.3f} s (fastest); fit's speed {speed}; "
          f"batching: {decisions.get('batching')}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
