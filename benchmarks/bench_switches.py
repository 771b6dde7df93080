"""Claim: fit's automatic switches, measured on the run's own first steps, are at least as fast as the best manual
precision x layout setting, for whole runs of 30 and 400 steps, with the trial's cost inside the run.

Models as a user calls them: torchvision's `resnet18(num_classes=10)` and `mobilenet_v3_small(num_classes=10)`
(ImageNet stems; any torchvision model by name, or timm's as `timm:NAME`) on 32 px images, batch 32, SGD with
the default one-cycle. In this one process, after a warm-up, interleaved over `--rounds` rounds, each row is a
complete `torchspeed.fit` of `--steps` steps from the same initial weights on the same batches, timed as a whole:

- the manual settings a user would try: fp32 and fp32 + channels_last, and where the CPU runs
  bf16 natively bf16 and bf16 + channels_last (`trial=False`, the switch fixed);
- `auto cold`: every switch on "auto", an empty decision cache: the trial runs inside the run;
- `auto warm`: every switch on "auto", the cache a previous run left: no step measured.

Each row's time is the median over rounds; `auto / best manual` is the median over rounds of the
per-round ratio best-manual time / auto time (above 1: auto is faster).

Run:
    python benchmarks/bench_switches.py --steps 30 400     # writes benchmarks/results/cpu/switches.json
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
from torchspeed.env import DeviceCaps, other_runnable


def _model(name: str, state: dict | None = None):
    """torchvision's `name`, or timm's for `timm:name` (the `[zoo]` extra), with a 10-class head."""
    torch.manual_seed(0)
    if name.startswith("timm:"):
        import timm

        m = timm.create_model(name[5:], pretrained=False, num_classes=10)
    else:
        import torchvision

        m = getattr(torchvision.models, name)(num_classes=10)
    if state is not None:
        m.load_state_dict(state)
    return m


def _loader(batch: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch * steps, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(1))


def _fit(name: str, init: dict, loader: DataLoader, steps: int, cache: str, **switches) -> tuple[float, dict]:
    os.environ["TORCHSPEED_CACHE_DIR"] = cache
    model = _model(name, init)
    t0 = time.perf_counter()
    res = torchspeed.fit(model, loader, epochs=1, max_steps=steps, lr=0.05, schedule="onecycle", progress=False,
                         compile=False, **switches)
    return time.perf_counter() - t0, res.decisions


def manual_settings() -> dict[str, dict]:
    """The precision x layout settings a user would try by hand on this CPU: fp32 and fp32 + channels_last, and
    bf16 and bf16 + channels_last where it runs bf16 natively (label -> fit's keywords)."""
    manual = {"fp32": dict(precision="fp32", channels_last=False),
              "fp32+channels_last": dict(precision="fp32", channels_last=True)}
    if DeviceCaps.of("cpu").half == "bf16":
        manual |= {"bf16": dict(precision="bf16", channels_last=False),
                   "bf16+channels_last": dict(precision="bf16", channels_last=True)}
    return manual


def measure(name: str, steps: int, batch: int, rounds: int) -> dict:
    init = _model(name).state_dict()
    loader = _loader(batch, steps)
    manual = manual_settings()
    warm_cache = tempfile.mkdtemp(prefix="switches-warm-")
    _fit(name, init, loader, steps, warm_cache)  # the previous run that leaves the cache (and warms up)
    rows = {k: (lambda kw=kw: _fit(name, init, loader, steps, tempfile.mkdtemp(), trial=False, **kw))
            for k, kw in manual.items()}
    rows["auto cold"] = lambda: _fit(name, init, loader, steps, tempfile.mkdtemp(prefix="switches-cold-"))
    rows["auto warm"] = lambda: _fit(name, init, loader, steps, warm_cache)
    times: dict[str, list[float]] = {k: [] for k in rows}
    decisions: dict[str, dict] = {}
    for r in range(rounds):
        for k, run in rows.items():
            sec, d = run()
            times[k].append(sec)
            if k.startswith("auto"):
                decisions[k] = {x: str(d.get(x)) for x in ("precision", "channels_last", "fused_optimizer",
                                                            "switch_trial")}
            print(f"{name} {steps} steps, round {r + 1}: {k:22s} {sec:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(manual, key=med.get)
    out = {"model": name, "steps": steps, "batch_size": batch, "rounds": rounds, "seconds": times, "median_s": med,
           "best_manual": best, "decisions": decisions}
    for k in ("auto cold", "auto warm"):
        out[f"{k} / best manual"] = statistics.median(b / a for a, b in zip(times[k], times[best]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v3_small"])
    ap.add_argument("--steps", nargs="+", type=int, default=[30, 400])
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/cpu/switches.json")
    args = ap.parse_args()
    load_before = other_runnable()
    results = [measure(m, s, args.batch_size, args.rounds) for m in args.models for s in args.steps]
    out = {"claim": "fit's automatic switches (trial inside the run) vs the best manual precision x layout setting, "
                    "whole runs, one process, interleaved rounds", "results": results,
           "other_runnable_before": load_before, "other_runnable_after": other_runnable(), "meta": provenance()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    for r in results:
        print(f"{r['model']:20s} {r['steps']:4d} steps: best manual {r['best_manual']} {r['median_s'][r['best_manual']]:.2f} s; "
              f"auto cold {r['auto cold / best manual']:.2f}x, auto warm {r['auto warm / best manual']:.2f}x "
              f"(chose {r['decisions']['auto cold']['precision']}, channels_last {r['decisions']['auto cold']['channels_last']})")


if __name__ == "__main__":
    main()
