"""Claim: Schedule-Free AdamW's update on a model of large tensors costs less a piece at a time (T51, T42).

`recipe="auto"` trains with Schedule-Free AdamW. The package's `step()` runs ten foreach ops, each over every
parameter: on a model of large tensors each op streams the whole model through memory, and on a CPU with a small
batch the update can cost what the forward and backward cost (ResNet-18 at 32 px, batch 8: about 37 ms against
63 ms here). `LeanScheduleFree` runs the same ops a piece of `CHUNK` numbers at a time (`Chunks`), the package's
numbers bit for bit. This times the update alone, on each model's own parameters with fixed gradients:

- `package`: `AdamWScheduleFree.step()` as the package runs it (foreach);
- `lean`: `torchspeed.train.loop.lean_step.optimizer_step` (what `fit` calls), pieces where they apply;
- `lean_whole`: the same without the pieces (`Chunks.of` patched to None): what the lean step did before.

Rounds interleave the three in turn (the order rotating); each reading is the median of `--steps` updates. The
JSON records every reading, the medians and their ratios, with the commit, versions and device. Nothing is
asserted.

Run:
    python benchmarks/bench_sf_step.py --out benchmarks/results/cpu-avx512-bf16/sf_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from torchspeed.bench.runner import provenance
from torchspeed.train import lean_schedulefree
from torchspeed.train.loop.lean_step import lean_step_for
from torchspeed.train.loop.step import optimizer_step

WAYS = ("package", "lean", "lean_whole")


def models() -> dict[str, nn.Module]:
    import torchvision
    return {"resnet18": torchvision.models.resnet18(num_classes=10),
            "efficientnet_b0": torchvision.models.efficientnet_b0(num_classes=10),
            "mlp_2048": nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                      nn.Linear(2048, 10))}


def _optimizer(model: nn.Module):
    import schedulefree
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = schedulefree.AdamWScheduleFree([{"params": rest, "weight_decay": 0.0},
                                          {"params": decay, "weight_decay": 0.05}], lr=1e-3, warmup_steps=10)
    opt.train()
    return opt


def time_way(model: nn.Module, way: str, steps: int) -> float:
    """The median seconds of `steps` updates, after 2 untimed (the first makes the state)."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in model.parameters()]
    opt = _optimizer(model)
    real = lean_schedulefree.Chunks.of
    if way == "lean_whole":
        lean_schedulefree.Chunks.of = classmethod(lambda cls, *a: None)
    try:
        times = []
        for i in range(steps + 2):
            for p, gr in zip(model.parameters(), grads):
                p.grad = gr.clone()
            t0 = time.perf_counter()
            opt.step() if way == "package" else optimizer_step(opt)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        lean = lean_step_for(opt) if way != "package" else None
        if way == "lean" and lean is not None and getattr(lean, "chunk_steps", 0) == 0:
            print(f"  note: {way} ran no chunked update here")
        return statistics.median(times)
    finally:
        lean_schedulefree.Chunks.of = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = {"provenance": provenance(), "chunk": lean_schedulefree.CHUNK, "rounds": args.rounds, "steps": args.steps,
           "models": {}}
    for name, model in models().items():
        params = [p.detach().clone() for p in model.parameters()]
        readings = {w: [] for w in WAYS}
        for r in range(args.rounds):
            for way in WAYS[r % 3:] + WAYS[:r % 3]:
                with torch.no_grad():  # every way from the same weights
                    for p, p0 in zip(model.parameters(), params):
                        p.copy_(p0)
                readings[way].append(time_way(model, way, args.steps))
        med = {w: statistics.median(v) for w, v in readings.items()}
        out["models"][name] = {"numel": sum(p.numel() for p in params), "tensors": len(params),
                               "ms": {w: [round(x * 1e3, 2) for x in v] for w, v in readings.items()},
                               "median_ms": {w: round(v * 1e3, 2) for w, v in med.items()},
                               "package_over_lean": round(med["package"] / med["lean"], 3),
                               "lean_whole_over_lean": round(med["lean_whole"] / med["lean"], 3)}
        m = out["models"][name]
        print(f"{name}: {m['numel'] / 1e6:.1f}M numbers in {m['tensors']} tensors; median ms {m['median_ms']}; "
              f"package/lean {m['package_over_lean']}x, lean_whole/lean {m['lean_whole_over_lean']}x", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
