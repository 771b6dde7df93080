"""Claim: DistributedDataParallel over 2 CPU processes (gloo) against 1 process, in one run (T31).

What is measured: samples/s of the training step (forward, backward, gradient all-reduce,
SGD step) for torchrun jobs of 1 and 2 processes, each process with the same number of
intra-op threads and the same per-process batch (weak scaling), plus one process using the
cores of both (the same-hardware comparison). Jobs are fresh `torch.distributed.run`
processes, interleaved round by round with alternating order; each times `windows`
windows of `steps` steps after a warm-up and reports the median window; a row is the
median over rounds. Raw per-round numbers are saved.

Hardware and software: recorded in the JSON (`provenance`). Ratios are what to compare;
absolute samples/s hold for the machine named there only.

Run:
    python benchmarks/bench_distributed.py            # ~5 minutes on 2 CPU cores
    python benchmarks/bench_distributed.py --quick    # ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import time

from torchspeed.bench.runner import provenance
from torchspeed.bench.scaling import measure_scaling

WORKLOADS = {  # name: (model, per-process batch, steps per window)
    "mlp": ("mlp", 64, 30),
    "resnet18": ("resnet18", 16, 4),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu", "bench_distributed.json"))
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    results = {}
    t0 = time.time()
    for name, (model, batch, steps) in WORKLOADS.items():
        if args.quick and name != "mlp":
            continue
        r = measure_scaling(nproc=args.nproc, model=model, batch_size=batch, steps=steps, warmup=2,
                            rounds=rounds, windows=3, device="cpu")
        results[name] = r.to_dict()
        print(f"{name}: " + ", ".join(f"{row.name} {row.samples_per_s:,.1f}/s" for row in r.rows))
        print("    " + ", ".join(f"{k}: {v:.2f}x" for k, v in r.ratios.items()))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    out = {"benchmark": "bench_distributed", "claim": __doc__.splitlines()[0], "results": results,
           "wall_s": round(time.time() - t0, 1), "loadavg_at_end": load, "provenance": provenance()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
