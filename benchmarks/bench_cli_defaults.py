"""Do `torchspeed train`'s defaults learn? The default run against the best of three hand-picked LRs.

Claim: on a new folder, `torchspeed train --data DIR --epochs 15` with no other option (the
LR from the range test, the per-optimizer weight decay, --size auto, the best epoch
restored) reaches at least the validation accuracy of the best of three hand-picked peak
LRs a decade apart, trained for the same epochs with everything else equal.

Method: a generated folder of JPEGs (4 classes x 100, longer side 96 px; the default split
holds out 40 for validation, 360 train). For each seed, the default run and one run per
hand-picked LR (--lr 0.01, 0.1, 1.0) are interleaved; each reports the validation accuracy
of its final model (the restored best epoch) and of its last epoch. A small model
(`--model simple_cnn`, 30k parameters) keeps the whole comparison to minutes on 2 CPU
cores (ResNet-18 took 5-8 minutes per run there, with other jobs on the cores); everything
else is the CLI's default (--size auto, SGD, batch 64, one-cycle, restore best). Results with provenance (commit, versions,
device) and the machine load go to benchmarks/results/cpu/cli_defaults.json.

    python benchmarks/bench_cli_defaults.py [--seeds 0 1] [--epochs 15] [--model simple_cnn]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

from torchspeed._io import write_json
from torchspeed.bench.runner import provenance
from torchspeed.cli.main import main as cli
from torchspeed.data import make_jpeg_folder
from torchspeed.env import other_runnable

HAND_LRS = (0.01, 0.1, 1.0)
OUT = Path(__file__).resolve().parent / "results" / "cpu" / "cli_defaults.json"


def _train(data: Path, out: Path, *, epochs: int, model: str, size: str, seed: int, lr: float | None) -> dict:
    argv = ["train", "--data", str(data), "--epochs", str(epochs), "--model", model, "--size", size,
            "--seed", str(seed), "--out", str(out), "--no-progress"] + (["--lr", str(lr)] if lr is not None else [])
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(argv)
    if code != 0:
        raise SystemExit(f"torchspeed {' '.join(argv)} failed with exit code {code}")
    run = json.loads((out / "run.json").read_text())
    history = json.loads((out / "metrics.json").read_text())["history"]
    best = max(h["val_acc"] for h in history)
    return {"lr": run["lr"], "val_acc_final_model": best if "restored_best" in run["fit_decisions"]
            else history[-1]["val_acc"], "val_acc_last_epoch": history[-1]["val_acc"],
            "val_acc_per_epoch": [h["val_acc"] for h in history], "lr_find": run["fit_decisions"].get("lr_find"),
            "size": run["pipeline"]["size"], "train_images": run["data"]["train_images"],
            "val_images": run["data"]["val_images"], "epoch_s": sum(h["epoch_s"] for h in history)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--model", default="simple_cnn")
    ap.add_argument("--size", default="auto", help="training side in pixels (auto: the images' median side)")
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args()
    load_before, meta = other_runnable(), provenance()  # the commit that runs, recorded before it runs
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = make_jpeg_folder(Path(tmp) / "data", n_per_class=100, classes=4, max_side=96, seed=0)
        for seed in args.seeds:
            for lr in (None, *HAND_LRS):
                name = "default" if lr is None else f"lr={lr:g}"
                r = _train(data, Path(tmp) / f"{name}-{seed}", epochs=args.epochs, model=args.model, size=args.size,
                           seed=seed, lr=lr)
                rows.append({"run": name, "seed": seed, **r})
                print(f"seed {seed} {name:9s} lr {r['lr']:.3g}: val_acc {r['val_acc_final_model']:.3f} "
                      f"(last epoch {r['val_acc_last_epoch']:.3f}), {r['epoch_s']:.0f} s", flush=True)
    verdict = {}
    for seed in args.seeds:
        mine = next(r for r in rows if r["seed"] == seed and r["run"] == "default")
        hand = max((r for r in rows if r["seed"] == seed and r["run"] != "default"),
                   key=lambda r: r["val_acc_final_model"])
        verdict[str(seed)] = {"default": mine["val_acc_final_model"], "best_hand": hand["val_acc_final_model"],
                              "best_hand_lr": hand["lr"], "default_lr": mine["lr"],
                              "default_at_least_best_hand": mine["val_acc_final_model"] >= hand["val_acc_final_model"]}
    result = {"meta": meta | {"command": "python benchmarks/bench_cli_defaults.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k != "json"),
                  "other_runnable_before": load_before, "other_runnable_after": other_runnable(),
                  "hand_lrs": HAND_LRS, "epochs": args.epochs, "model": args.model, "size": args.size},
              "rows": rows, "verdict": verdict}
    write_json(args.json, result)
    for seed, v in verdict.items():
        print(f"seed {seed}: default {v['default']:.3f} (lr {v['default_lr']:.3g}) vs best hand-picked "
              f"{v['best_hand']:.3f} (lr {v['best_hand_lr']:g}): "
              + ("at least as good" if v["default_at_least_best_hand"] else "WORSE"))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
