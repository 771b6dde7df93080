"""Does Muon (hidden matrices) + AdamW (the rest) learn faster than AdamW alone? The bench GPT on text (T42).

Claim tested: with `optimizer="muon"` (torch's Muon with `adjust_lr_fn="match_rms_adamw"` for
the hidden weight matrices, AdamW for embeddings, head, biases and norms) the bench's `gpt`
reaches a lower validation loss than with `optimizer="adamw"` after the same number of steps.

Method: for each optimizer, learning rate and seed, one `fit` of the bench `gpt` (bytes of the
Python standard library, block 128; `--size tiny`: 2 layers of width 64, `small`: the bench
default, 4 layers of width 128) for `--steps` optimizer steps (one epoch over steps x batch
windows, batch 16), one-cycle to the peak LR, clip 1.0, fp32, the default weight decay (0.05
for both), no compile. Every arm of a seed starts from the same weights and sees the same
batches. The validation loss is on 256 held-out windows (the last 10% of the text) at the end.
Results (per run, and per optimizer and LR the mean over seeds) go to
benchmarks/results/cpu/muon.json with provenance (commit, versions, machine, its load).

    python benchmarks/bench_muon.py [--size tiny] [--steps 300] [--seeds 2]
                                    [--adamw-lrs 3e-3,1e-2,3e-2] [--muon-lrs 3e-3,1e-2,3e-2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import torchspeed
from torchspeed._io import write_json
from torchspeed.bench.runner import provenance
from torchspeed.bench.text import GPT
from torchspeed.bench.workloads import BLOCK_SIZE, make_datasets
from torchspeed.env import other_runnable
from torchspeed.train.optim import matrix_share

OUT = Path(__file__).resolve().parent / "results" / "cpu" / "muon.json"
SIZES = {"tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64}, "small": {"n_layer": 4, "n_head": 4, "n_embd": 128}}


def run(optimizer: str, lr: float, seed: int, *, size: str, steps: int, batch_size: int, train, val) -> dict:
    torch.manual_seed(seed)
    model = GPT(block_size=BLOCK_SIZE, **SIZES[size])
    loader = DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    res = torchspeed.fit(model, loader, optimizer=optimizer, lr=lr, epochs=1, val_loader=DataLoader(val, batch_size=64),
                         schedule="onecycle", clip_grad_norm=1.0, precision="fp32", compile=False, progress=False,
                         seed=seed, restore_best=False, max_steps=steps, trial=False)
    last = res.history[-1]
    return {"optimizer": optimizer, "lr": lr, "seed": seed, "steps": res.steps, "val_loss": last["val_loss"],
            "train_loss": last["train_loss"], "seconds": time.perf_counter() - t0,
            "decision": str(res.decisions.get("optimizer"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--adamw-lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--muon-lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    train, val = make_datasets("text", train_size=args.steps * args.batch_size, val_size=256)
    arms = ([("adamw", float(x)) for x in args.adamw_lrs.split(",")]
            + [("muon", float(x)) for x in args.muon_lrs.split(",")])
    load_before = other_runnable()
    runs = []
    for seed in range(args.seeds):
        for opt, lr in arms:
            runs.append(run(opt, lr, seed, size=args.size, steps=args.steps, batch_size=args.batch_size,
                            train=train, val=val))
            r = runs[-1]
            print(f"seed {seed} {opt:>5} lr {lr:g}: val_loss {r['val_loss']:.4f} train_loss {r['train_loss']:.4f} "
                  f"({r['seconds']:.0f} s)", flush=True)
    summary = []
    for opt, lr in arms:
        vals = [r["val_loss"] for r in runs if r["optimizer"] == opt and r["lr"] == lr]
        secs = [r["seconds"] for r in runs if r["optimizer"] == opt and r["lr"] == lr]
        summary.append({"optimizer": opt, "lr": lr, "val_loss_mean": statistics.mean(vals), "val_loss": vals,
                        "seconds_mean": statistics.mean(secs)})
    best = {o: min((s for s in summary if s["optimizer"] == o), key=lambda s: s["val_loss_mean"])
            for o in ("adamw", "muon")}
    for s in summary:
        print(f"{s['optimizer']:>5} lr {s['lr']:g}: val_loss {s['val_loss_mean']:.4f} "
              f"({', '.join(f'{v:.4f}' for v in s['val_loss'])}), {s['seconds_mean']:.0f} s per run")
    gain = 1 - best["muon"]["val_loss_mean"] / best["adamw"]["val_loss_mean"]
    print(f"best muon (lr {best['muon']['lr']:g}) vs best adamw (lr {best['adamw']['lr']:g}): "
          f"{gain:+.1%} lower val loss")
    model = GPT(block_size=BLOCK_SIZE, **SIZES[args.size])
    meta = provenance() | {
        "workload": f"gpt ({args.size}: {SIZES[args.size]}, block {BLOCK_SIZE}, "
                    f"{sum(p.numel() for p in model.parameters()):,} parameters, "
                    f"{matrix_share(model):.0%} in hidden matrices) on text ({getattr(train, 'source', 'text')})",
        "steps": args.steps, "batch_size": args.batch_size, "schedule": "onecycle", "clip_grad_norm": 1.0,
        "precision": "fp32", "weight_decay": "default (0.05 for both)", "val_windows": len(val),
        "other_runnable_before": load_before, "other_runnable_after": other_runnable()}
    write_json(args.out, {"meta": meta, "summary": summary,
                          "best": {o: {"lr": b["lr"], "val_loss_mean": b["val_loss_mean"]} for o, b in best.items()},
                          "muon_gain_vs_adamw": gain, "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
