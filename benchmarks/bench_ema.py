"""Does an EMA of the weights help? Validation accuracy of ResNet-20 on the digits, with and without EMA.

Claim: evaluating an exponential moving average of the weights (`torchspeed.EMA`) matches or
improves validation accuracy over the trained weights, on the digits workload, over 3 seeds.

Method: for each seed, one `fit` of ResNet-20 on scikit-learn's digits (32 px, batch 64, SGD
momentum 0.9, one-cycle to lr 0.1, fp32) with `callbacks=[EMA(d) for d in decays]`. The
first EMA is the one `fit` validates (its `val_acc` is the history's); a small callback also
evaluates the trained weights and every other EMA on the same validation set at each epoch
end. The EMA never changes the training itself, so every column of a seed comes from the
same run: a paired comparison, no run-to-run noise between the arms. Results (per seed,
per epoch, and the final epoch's mean and spread) go to benchmarks/results/cpu/ema.json
with provenance (commit, versions, machine, its load).

    python benchmarks/bench_ema.py [--epochs 8] [--seeds 3] [--decays 0.9,0.999] [--plain-decays 0.98]
    # or one process per seed, then one file:
    python benchmarks/bench_ema.py --seed-list 1 --out /tmp/ema_1.json   (for each seed)
    python benchmarks/bench_ema.py --merge /tmp/ema_0.json /tmp/ema_1.json /tmp/ema_2.json

`--decays` use the default warm-up (d = min(decay, (1+t)/(10+t))); `--plain-decays` a fixed d
from the first step (`EMA(d, warmup=False)`), to show what the warm-up is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import torchspeed
from torchspeed._io import write_json
from torchspeed.bench.runner import provenance
from torchspeed.bench.workloads import create_model, digits
from torchspeed.env import other_runnable
from torchspeed.train.loop.callbacks import EMA, Callback
from torchspeed.train.evaluate import evaluate

OUT = Path(__file__).resolve().parent / "results" / "cpu" / "ema.json"


def _arm(ema: EMA) -> str:
    return f"ema_{ema.decay:g}" + ("" if ema.warmup else "_nowarmup")


class EvalEach(Callback):
    """At each epoch end: val accuracy of the trained weights and of every EMA (the first one is fit's val_acc)."""

    def __init__(self, val_loader, emas: list[EMA]):
        self.val_loader, self.emas, self.rows = val_loader, emas, []

    def on_evaluate(self, trainer, metrics):
        row = {"epoch": metrics["epoch"], "step": trainer.step, "fit_val_acc": metrics["val_acc"],
               "trained": evaluate(trainer.module, self.val_loader, device=trainer.device)["val_acc"]}
        row[_arm(self.emas[0])] = metrics["val_acc"]  # fit validated the first EMA already
        for ema in self.emas[1:]:
            row[_arm(ema)] = evaluate(ema.module, self.val_loader, device=trainer.device)["val_acc"]
        trainer.module.train()
        self.rows.append(row)


def run_seed(seed: int, *, epochs: int, decays: list[float], plain: list[float], batch_size: int,
             lr: float) -> list[dict]:
    train, val = digits(seed=0)  # one split; the seed changes the initial weights and the batch order
    g = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True, generator=g)
    val_loader = DataLoader(val, batch_size=256)
    torch.manual_seed(seed)
    model = create_model("resnet20", num_classes=10)
    emas = [EMA(d, apply_at_end=False) for d in decays] + [EMA(d, warmup=False, apply_at_end=False) for d in plain]
    probe = EvalEach(val_loader, emas)
    torchspeed.fit(model, train_loader, epochs=epochs, val_loader=val_loader, optimizer="sgd", lr=lr,
                   weight_decay=5e-4, precision="fp32", compile=False, progress=False, seed=seed, schedule="onecycle",
                   callbacks=[*emas, probe])
    return probe.rows


def summarize(runs: dict, arms: list[str]) -> dict:
    summary = {}
    for arm in arms:
        final = [runs[s][-1][arm] for s in runs]
        summary[arm] = {"final_val_acc_mean": statistics.mean(final),
                        "final_val_acc_stdev": statistics.stdev(final) if len(final) > 1 else 0.0,
                        "final_val_acc": final,
                        "minus_trained_per_seed": [runs[s][-1][arm] - runs[s][-1]["trained"] for s in runs]}
        print(f"{arm:>18}: final val_acc {summary[arm]['final_val_acc_mean']:.4f} "
              f"+- {summary[arm]['final_val_acc_stdev']:.4f}  (minus trained, per seed: "
              f"{', '.join(f'{d:+.4f}' for d in summary[arm]['minus_trained_per_seed'])})")
    return summary


def merge(paths: list[str], out: str) -> None:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    runs = {k: v for part in parts for k, v in part["runs"].items()}
    meta = dict(parts[0]["meta"], merged_from=len(parts),
                other_runnable_before=[p["meta"]["other_runnable_before"] for p in parts],
                other_runnable_after=[p["meta"]["other_runnable_after"] for p in parts])
    arms = [k for k in next(iter(runs.values()))[-1] if k not in ("epoch", "step", "fit_val_acc")]
    write_json(out, {"meta": meta, "summary": summarize(runs, arms), "runs": dict(sorted(runs.items()))})
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-list", default=None, help="comma-separated seeds (default: 0 .. seeds-1)")
    ap.add_argument("--decays", default="0.9,0.999")
    ap.add_argument("--plain-decays", default="0.98")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--merge", nargs="+", default=None, help="JSON files of single-seed runs to combine into --out")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    decays = [float(d) for d in args.decays.split(",")]
    plain = [float(d) for d in args.plain_decays.split(",") if d]
    seeds = [int(x) for x in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
    load_before = other_runnable()
    runs = {}
    for seed in seeds:
        runs[str(seed)] = run_seed(seed, epochs=args.epochs, decays=decays, plain=plain, batch_size=args.batch_size,
                                   lr=args.lr)
        last = runs[str(seed)][-1]
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k not in ("epoch", "step")))
    arms = ["trained"] + [f"ema_{d:g}" for d in decays] + [f"ema_{d:g}_nowarmup" for d in plain]
    meta = provenance() | {"workload": "resnet20 on digits (32 px, 1348 train / 449 val)", "epochs": args.epochs,
                           "batch_size": args.batch_size, "lr_peak": args.lr, "optimizer": "sgd momentum 0.9",
                           "schedule": "onecycle", "precision": "fp32", "decays": decays,
                           "plain_decays": plain, "warmup": "d = min(decay, (1 + t) / (10 + t)) at update t",
                           "validated_by_fit": f"ema_{decays[0]:g}",
                           "other_runnable_before": load_before, "other_runnable_after": other_runnable()}
    write_json(args.out, {"meta": meta, "summary": summarize(runs, arms), "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
