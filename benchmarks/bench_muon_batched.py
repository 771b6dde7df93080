"""Muon's Newton-Schulz batched over the matrices (`BatchedMuon`) against torch's per-matrix `torch.optim.Muon` (T42).

Two measurements, each interleaved (the arms alternate, the order flipping each round) after a warm-up:

1. The optimizer step alone, on the hidden matrices of the bench's GPT at three widths (random gradients):
   torch's Muon, and `BatchedMuon` with pad "all" (one padded tensor), "shape" (a stack per shape) and "auto".
2. What a user runs: `fit(gpt, optimizer="muon")` (Muon for the hidden matrices, AdamW for the rest) on the
   bench's text for `--steps` steps, with `MuonAdamW`'s Muon part as torch's (baseline) or batched (now), from
   the same seed, weights and batches: the whole run's seconds and its final training loss (the two differ
   only by bf16 roundings in the Newton-Schulz products).

    python benchmarks/bench_muon_batched.py [--steps 150] [--rounds 5]

Writes benchmarks/results/<cpu kind>/muon_batched.json with provenance.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import torchspeed
import torchspeed.train.muon as muon_module
from torchspeed._io import write_json
from torchspeed.bench.runner import cpu_kind, provenance
from torchspeed.bench.text import GPT
from torchspeed.bench.workloads import BLOCK_SIZE, make_datasets
from torchspeed.env import other_runnable
from torchspeed.train.muon_batched import BatchedMuon
from torchspeed.train.optim import hidden_matrices

SIZES = {"tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64}, "small": {"n_layer": 4, "n_head": 4, "n_embd": 128},
         "wide": {"n_layer": 6, "n_head": 6, "n_embd": 384}}


def _interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:
    for f in fns.values():  # warm-up: each arm's first calls (allocations, oneDNN primitives)
        f(), f()
    out = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[k]()
            out[k].append(time.perf_counter() - t0)
    return out


def step_only(size: str, rounds: int) -> dict:
    torch.manual_seed(0)
    model = GPT(block_size=BLOCK_SIZE, **SIZES[size])
    hidden = [p for _, p in hidden_matrices(model)[0]]
    for p in hidden:
        p.grad = torch.randn_like(p)
    kw = dict(lr=1e-3, adjust_lr_fn="match_rms_adamw")
    opts = {"torch": torch.optim.Muon(hidden, **kw),
            **{f"batched_{pad}": BatchedMuon(hidden, pad=pad, **kw) for pad in ("all", "shape", "auto")}}
    secs = _interleaved({k: o.step for k, o in opts.items()}, rounds)
    base = statistics.median(secs["torch"])
    return {"size": size, "config": SIZES[size], "matrices": len(hidden),
            "shapes": sorted({tuple(p.shape) for p in hidden}),
            "ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in secs.items()},
            "speedup_vs_torch": {k: round(base / statistics.median(v), 3) for k, v in secs.items()}}


def fit_run(size: str, steps: int, batched: bool, train) -> tuple[float, float]:
    muon_module.BatchedMuon = BatchedMuon if batched else _TorchMuon
    try:
        torch.manual_seed(0)
        model = GPT(block_size=BLOCK_SIZE, **SIZES[size])
        loader = DataLoader(train, batch_size=16, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        res = torchspeed.fit(model, loader, optimizer="muon", lr=1e-2, schedule="onecycle", clip_grad_norm=1.0,
                             precision="fp32", compile=False, progress=False, seed=0, max_steps=steps, trial=False)
        return time.perf_counter() - t0, float(res.history[-1]["train_loss"])
    finally:
        muon_module.BatchedMuon = BatchedMuon


class _TorchMuon(torch.optim.Muon):
    """torch's Muon, taking (and ignoring) the `pad` keyword: the baseline arm."""

    def __init__(self, params, *args, pad: str = "auto", **kwargs):
        super().__init__(params, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-rounds", type=int, default=21)
    ap.add_argument("--fit-sizes", default="tiny,small")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load_before = other_runnable()
    steps = [step_only(s, args.step_rounds) for s in SIZES]
    for s in steps:
        print(s["size"], s["ms"], s["speedup_vs_torch"], flush=True)
    train, _ = make_datasets("text", train_size=args.steps * 16, val_size=64)
    fits = []
    for size in args.fit_sizes.split(","):
        secs: dict[str, list[float]] = {"torch": [], "batched": []}
        losses = {}
        fit_run(size, 4, True, train)  # the process's one-time costs
        for r in range(args.rounds):
            for arm in (("torch", "batched") if r % 2 == 0 else ("batched", "torch")):
                sec, loss = fit_run(size, args.steps, arm == "batched", train)
                secs[arm].append(sec)
                losses[arm] = loss
        row = {"size": size, "steps": args.steps, "seconds": {k: [round(x, 3) for x in v] for k, v in secs.items()},
               "speedup_whole_run": round(statistics.median(secs["torch"]) / statistics.median(secs["batched"]), 3),
               "final_train_loss": losses}
        print(row, flush=True)
        fits.append(row)
    prov = provenance()
    kind = cpu_kind(prov)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / kind / "muon_batched.json"
    write_json(out, {"meta": {**prov, "command": "python benchmarks/bench_muon_batched.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "other_runnable_before": load_before, "other_runnable_after": other_runnable()},
        "step_only": steps, "fit": fits})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
