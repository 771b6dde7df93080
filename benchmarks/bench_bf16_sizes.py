"""Where bf16 autocast pays on this CPU: a 3-layer MLP's training step in bf16 against fp32, by width and batch (T21).

Backs the CPU rule `switch_choice.small_products` (a model without convolutions whose weight matrices all hold at
most 65,536 elements keeps fp32 by rule): autocast casts each weight every forward, so a small product's cast
costs what bf16 saves. For each width and batch: forward, cross-entropy and backward of
Linear(w, w) -> ReLU -> Linear(w, w) -> ReLU -> Linear(w, 10), 25 timed steps per side after 5 warm-up steps,
the sides alternating, 3 repeats; the speed-up is the median of the repeats' fp32 / bf16 median step times.

    python benchmarks/bench_bf16_sizes.py [--out benchmarks/results/<cpu kind>/bf16_sizes.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from torchspeed._io import write_json
from torchspeed.bench.runner import cpu_kind, provenance
from torchspeed.env import other_runnable

WIDTHS = (64, 128, 256, 512, 1024)
BATCHES = (32, 256)


def step_s(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool, steps: int = 25) -> float:
    def one():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
    for _ in range(5):
        one()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prov = provenance()
    kind = cpu_kind(prov)
    load = other_runnable()
    rows = []
    for w in WIDTHS:
        for b in BATCHES:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
            x, y = torch.randn(b, w), torch.randint(0, 10, (b,))
            ratios = []
            for r in range(args.repeats):
                sides = (False, True) if r % 2 == 0 else (True, False)
                t = {bf: step_s(model, x, y, bf) for bf in sides}
                ratios.append(t[False] / t[True])
            row = {"width": w, "batch": b, "largest_matrix": w * w, "bf16_speedup": round(statistics.median(ratios), 3),
                   "repeats": [round(r, 3) for r in ratios]}
            print(row, flush=True)
            rows.append(row)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / kind / "bf16_sizes.json"
    write_json(out, {"meta": {**prov, "command": "python benchmarks/bench_bf16_sizes.py",
                              "other_runnable_before": load, "other_runnable_after": other_runnable()},
                     "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
