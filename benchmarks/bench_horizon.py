"""Claim: which optimizer `fit(recipe="auto")` should take, unmeasured, by the run's length and the model's kind.

When a run is too short to afford the optimizer trial, auto takes a prior (`plan/recipe_optimizer.py`). This bench
measures the candidates a prior could be, at several run lengths, on each workload of the suite
(`torchspeed.bench.suite`: an image CNN, a tabular MLP, a regression, a 1D CNN, a transformer and a GRU
language model, each on data made offline), through `fit` as users call it, cold:

With `--workloads resnet20_digits,gpt_text`: two bench workloads the suite does not hold (`_register_extra`).

- `sf`: Schedule-Free AdamW at the LR the width rule gives (`train.optim.schedule_free_lr`): today's prior;
- `adamw`: AdamW by name at its default LR (what a prior that knows no LR takes), one-cycle over the run;
- `sgd`: SGD by name (momentum 0.9) at its default LR, one-cycle over the run (fit's default optimizer);
- `adamw_wsd`, `adamw_linear`: AdamW at its default LR with a warmup-stable-decay schedule (the last 20% cooled to
  zero) or a linear decay to zero (`train.schedule`), the schedules a run of unknown horizon and recent LLM
  practice use;
- `adamw_constant`: AdamW at its default LR held constant after fit's warm-up (no cooldown: what a loop without a
  scheduler trains with);
- `adamw_wsd_width`: AdamW with warmup-stable-decay at the LR the width rule gives Schedule-Free (is it Schedule-Free
  that wins, or its LR?);
- `tuned` (asked for by `--candidates`): the workload's own optimizer at its own tuned LR, one-cycle over the run (a
  reference no prior knows).

Each run trains `frac` x the workload's default steps (its plain loop's epochs), evaluates once at the end on the
held-out split (the weights a run ends with: Schedule-Free's average with BatchNorm recalibrated), and is timed as a
whole `fit` call. The candidates run in a shuffled order per (length, seed). Per workload and length: each
candidate's mean final metric and held-out loss over the seeds, its mean seconds, and the winner among the priors
(`sf`, `adamw`, `sgd`: the best mean metric; accuracies that round to the same half point tie, and the held-out
loss decides).

Run:
    python benchmarks/bench_horizon.py --out benchmarks/results/cpu-avx512-bf16/horizon.json
    python benchmarks/bench_horizon.py --workloads mlp,char_lm --fracs 0.25,1 --seeds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed import fit
from torchspeed.bench import suite
from torchspeed.bench.runner import provenance
from torchspeed.plan.recipe_horizon import TIE, model_kind
from torchspeed.train.optim import schedule_free_lr
from torchspeed.train.optim_info import default_lr

def _tensors(ds) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(xs), torch.stack([torch.as_tensor(y) for y in ys])


def _resnet20_digits(seed: int) -> suite.SuiteData:
    from torchspeed.bench.workloads import digits
    train, val = digits(size=32, seed=seed)
    return suite.SuiteData(*train.tensors, *val.tensors)


def _gpt_text(seed: int) -> suite.SuiteData:
    from torchspeed.bench.text import byte_text_datasets
    train, val = byte_text_datasets(train_size=4096, val_size=512, block_size=BLOCK_SIZE, seed=seed)
    return suite.SuiteData(*_tensors(train), *_tensors(val))


def _register_extra() -> None:
    """Two bench workloads the suite does not hold, a deep one and a language model: ResNet-20 (22 weight layers,
    BatchNorm) on the digits at 32 px (the bench's time-to-accuracy workload) and the bench's byte-level GPT on the
    standard library's source (`torchspeed bench --model gpt`)."""
    from torchspeed.bench.workloads import create_model
    suite.register_workload(suite.Workload(
        "resnet20_digits", "deep image CNN", _resnet20_digits, lambda: create_model("resnet20"), "sgd", 0.1, 64, 10,
        "cross_entropy", "val_acc", 0.97, "ResNet-20 on the digits at 32 px"), replace=True)
    suite.register_workload(suite.Workload(
        "gpt_text", "language model (attention)", _gpt_text, lambda: create_model("gpt"), "adamw", 3e-3, 32, 2,
        "cross_entropy", "val_loss", 2.5, "the bench's byte-level GPT on 128-byte windows"), replace=True)


BLOCK_SIZE = 128
EXTRA = ("resnet20_digits", "gpt_text")  # run when named in --workloads
CANDIDATES = ("sf", "adamw", "sgd", "adamw_wsd", "adamw_linear", "adamw_constant", "adamw_wsd_width", "tuned")
# what a prior may take: the tuned LR is known to no prior
PRIORS = ("sf", "adamw", "sgd", "adamw_wsd", "adamw_linear", "adamw_constant", "adamw_wsd_width")


def call(workload: suite.Workload, cand: str, model: nn.Module) -> dict:
    """fit's arguments for a candidate (beyond the model, the data and the run's length)."""
    kw: dict = {"loss_fn": nn.MSELoss() if workload.loss == "mse" else None, "progress": False}
    if cand == "sf":
        return kw | {"optimizer": "schedulefree", "lr": schedule_free_lr(model)[0]}
    if cand in ("adamw", "sgd"):
        return kw | {"optimizer": cand, "lr": default_lr(cand), "schedule": "onecycle"}
    if cand == "adamw_wsd_width":
        return kw | {"optimizer": "adamw", "lr": schedule_free_lr(model)[0], "schedule": "wsd"}
    if cand.startswith("adamw_"):  # AdamW at its default LR under another schedule ("wsd", "linear")
        return kw | {"optimizer": "adamw", "lr": default_lr("adamw"), "schedule": cand.split("_", 1)[1]}
    named = "sgd" if workload.optimizer == "sgd" else "adamw"
    return kw | {"optimizer": named, "lr": workload.lr, "schedule": "onecycle"}


def one_run(workload: suite.Workload, data: suite.SuiteData, cand: str, seed: int, steps: int) -> dict:
    """One cold `fit` run of `steps` steps; its final held-out metric and whole-call seconds."""
    with tempfile.TemporaryDirectory(prefix="torchspeed-horizon-") as cache:
        os.environ["TORCHSPEED_CACHE_DIR"] = cache
        torch.manual_seed(seed)
        model = workload.model()
        g = torch.Generator().manual_seed(seed)
        train = DataLoader(TensorDataset(data.x, data.y), batch_size=workload.batch_size, shuffle=True, generator=g)
        kw = call(workload, cand, model)
        epochs = math.ceil(steps / len(train))
        t0 = time.perf_counter()
        result = fit(model, train, epochs=epochs, max_steps=steps, **kw)
        seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        metric = suite.evaluate(workload, model, data.vx, data.vy)
        val_loss = float(suite.compute_loss(workload, model(data.vx), data.vy))
    lr = result.decisions.get("lr")
    return {"metric": float(metric), "val_loss": val_loss, "seconds": seconds, "steps": result.steps,
            "lr": kw.get("lr"), "optimizer": str(getattr(result.decisions.get("optimizer"), "value", ""))[:60],
            "finite": math.isfinite(float(metric)), "lr_decision": str(getattr(lr, "value", ""))[:40] if lr else None}


def summarize(rows: list[dict], workload: suite.Workload) -> dict:
    """Per candidate: the mean metric and seconds over the seeds; the winner among the priors."""
    out: dict = {}
    for cand in CANDIDATES:
        rs = [r for r in rows if r["cand"] == cand]
        if not rs:
            continue
        ms = [r["metric"] if math.isfinite(r["metric"]) else (-1.0 if workload.higher_is_better else 1e9) for r in rs]
        losses = [r["val_loss"] if math.isfinite(r["val_loss"]) else 1e9 for r in rs]
        out[cand] = {"metric": statistics.mean(ms), "val_loss": statistics.mean(losses),
                     "seconds": statistics.mean(r["seconds"] for r in rs), "per_seed": [round(m, 4) for m in ms]}
    priors = [c for c in PRIORS if c in out]
    out["winner"] = min(priors, key=lambda c: rank_key(out[c], workload.higher_is_better))
    return out


def rank_key(s: dict, higher: bool) -> tuple:
    """Best first: the metric (accuracies that round to the same multiple of TIE tie), then the held-out loss."""
    metric = -round(s["metric"] / TIE) if higher else s["metric"]
    return (metric, s["val_loss"])


def merged(entry: dict, earlier: dict, workload: suite.Workload) -> dict:
    """`entry` (this run's, one workload) with the earlier run's rows of every (candidate, seed) pair this run did
    not train, each length summarized again over all its rows; the earlier run's other lengths kept."""
    old = earlier["workloads"].get(workload.name)
    if old is None:
        return entry
    out = dict(entry, lengths={})
    for steps in sorted(set(old["lengths"]) | set(entry["lengths"]), key=int):
        new_rows = entry["lengths"].get(steps, {}).get("runs", [])
        ran = {(r["cand"], r["seed"]) for r in new_rows}
        old_len = old["lengths"].get(steps, {})
        rows = new_rows + [r for r in old_len.get("runs", []) if (r["cand"], r["seed"]) not in ran]
        frac = entry["lengths"].get(steps, old_len).get("frac")
        out["lengths"][steps] = {"frac": frac, "runs": rows, "summary": summarize(rows, workload)}
    return out


HEADS = {"sf": "Schedule-Free (width rule)", "adamw": "AdamW 1e-3, one-cycle", "sgd": "SGD 0.1, one-cycle",
         "adamw_wsd": "AdamW 1e-3, WSD", "adamw_linear": "AdamW 1e-3, linear to 0",
         "adamw_constant": "AdamW 1e-3, constant", "adamw_wsd_width": "AdamW (width rule), WSD"}
WORDS = {"sf": "Schedule-Free", "adamw": "AdamW", "sgd": "SGD", "adamw_wsd": "AdamW + WSD",
         "adamw_linear": "AdamW + linear", "adamw_constant": "AdamW + constant",
         "adamw_wsd_width": "AdamW (width) + WSD"}


def report(results: list[dict]) -> str:
    """The docs' table (docs/recipe.md) from the results: per workload and length each prior's mean held-out
    accuracy (held-out loss) or held-out loss, the winner in bold."""
    cands = [c for c in PRIORS if any(c in e["summary"] for r in results for w in r["workloads"].values()
                                      for e in w["lengths"].values())]
    lines = ["| workload (kind) | steps | " + " | ".join(HEADS[c] for c in cands) + " | best |",
             "|---|---|" + "---|" * len(cands) + "---|"]
    for r in results:
        for name, w in r["workloads"].items():
            acc = w["metric"] == "val_acc"
            for i, (steps, e) in enumerate(sorted(w["lengths"].items(), key=lambda kv: int(kv[0]))):
                s = e["summary"]
                seeds = sorted({row["seed"] for row in e["runs"]})
                head = (f"{name} ({w['kind']}, held-out {'accuracy' if acc else 'loss'}, {len(seeds)} "
                        f"seed{'s' if len(seeds) > 1 else ''})") if i == 0 else ""
                cells = []
                for c in cands:
                    if c not in s:
                        cells.append("-")
                        continue
                    v = f"{s[c]['metric']:.3f} ({s[c]['val_loss']:.3f})" if acc else f"{s[c]['metric']:.3f}"
                    cells.append(f"**{v}**" if c == s["winner"] else v)
                lines.append(f"| {head} | {steps} | " + " | ".join(cells) + f" | {WORDS[s['winner']]} |")
    return "\n".join(lines)


def pace(names: list[str], cands: list[str], fracs: list[float], rounds: int) -> dict:
    """Each candidate's whole-run seconds side by side: per workload and length, one cold `fit` run of each
    candidate per round (seed 0), interleaved after an untimed round (`rounds.interleaved`, order alternating);
    per candidate the seconds of every round and their median, and its median per-round ratio to the first
    candidate's seconds (above 1: faster than it)."""
    from torchspeed.train.rounds import interleaved
    out: dict = {}
    for w in suite.suite_workloads(names):
        data = suite.load_data(w)
        default_steps = w.epochs * math.ceil(len(data.x) / w.batch_size)
        for frac in fracs:
            steps = max(8, round(frac * default_steps))
            runs = {c: (lambda c=c: one_run(w, data, c, 0, steps)["seconds"]) for c in cands}
            r = interleaved(runs, rounds=rounds, warmup=1, order="alternate")
            times = {c: list(r.times[c]) for c in cands}
            base = times[cands[0]]
            out.setdefault(w.name, {})[str(steps)] = {
                c: {"seconds": [round(t, 3) for t in ts], "median_s": round(statistics.median(ts), 3),
                    "vs_first": round(statistics.median(b / t for b, t in zip(base, ts)), 3)}
                for c, ts in times.items()}
            print(w.name, steps, {c: v["median_s"] for c, v in out[w.name][str(steps)].items()}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=None, help="comma-separated suite workloads (default: all)")
    ap.add_argument("--fracs", default="0.125,0.25,0.5,1,2", help="run lengths as fractions of the default steps")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--candidates", default=",".join(PRIORS), help=f"of {','.join(CANDIDATES)}")
    ap.add_argument("--merge", default=None, help="an earlier run's JSON: its rows for other (candidate, seed) pairs "
                    "join this run's, and every length is summarized over both (final metrics, not seconds, are "
                    "compared, so runs made apart may be joined)")
    ap.add_argument("--report", nargs="+", default=None,
                    help="print the docs' table from these result files, run nothing")
    ap.add_argument("--pace", type=int, default=0, help="time the candidates' whole runs side by side in this many "
                    "interleaved rounds (seed 0) instead of judging their final metrics")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.report:
        print(report([json.loads(Path(f).read_text()) for f in a.report]))
        return
    if not a.out:
        ap.error("--out is required to run")
    logging.getLogger("torchspeed").setLevel(logging.ERROR)
    _register_extra()
    names = a.workloads.split(",") if a.workloads else [w.name for w in suite.suite_workloads() if w.name not in EXTRA]
    fracs = [float(f) for f in a.fracs.split(",")]
    cands = a.candidates.split(",")
    result = {"benchmark": "horizon", "claim": "the optimizer a prior should take by run length and model kind: "
              "final held-out metric of each candidate at each length, cold fit runs",
              "provenance": provenance(),
              "command": f"python benchmarks/bench_horizon.py --fracs {a.fracs} --seeds {a.seeds} "
                         + (f"--first-seed {a.first_seed} " if a.first_seed else "") + f"--candidates "
                         f"{a.candidates}" + (f" --workloads {a.workloads}" if a.workloads else "")
                         + (f" --merge {a.merge}" if a.merge else ""),
              "candidates": {"sf": "Schedule-Free AdamW at the width rule's LR, no schedule",
                             "adamw": f"AdamW at its default LR {default_lr('adamw'):g}, one-cycle",
                             "sgd": f"SGD (momentum 0.9) at its default LR {default_lr('sgd'):g}, one-cycle",
                             "adamw_wsd": f"AdamW at {default_lr('adamw'):g}, warmup-stable-decay (20% cooldown)",
                             "adamw_linear": f"AdamW at {default_lr('adamw'):g}, linear decay to zero",
                             "adamw_constant": f"AdamW at {default_lr('adamw'):g}, constant after fit's warm-up",
                             "adamw_wsd_width": "AdamW at the width rule's LR (Schedule-Free's), warmup-stable-decay",
                             "tuned": "the workload's own optimizer and LR, one-cycle (a reference)"},
              "workloads": {}}
    earlier = json.loads(Path(a.merge).read_text()) if a.merge else None
    if earlier:
        result["merged_from"] = {"file": Path(a.merge).name, "command": earlier.get("command"),
                                 "commit": earlier.get("provenance", {}).get("commit")}
    if a.pace:
        result["claim"] = "each candidate's whole cold fit run, seconds side by side (interleaved rounds)"
        result["command"] = result["command"].replace("--seeds", f"--pace {a.pace} --seeds")
        result["pace"] = pace(names, cands, fracs, a.pace)
        Path(a.out).write_text(json.dumps(result, indent=1))
        return
    rng = random.Random(0)
    t_all = time.perf_counter()
    for w in suite.suite_workloads(names):
        data = suite.load_data(w)
        per_epoch = math.ceil(len(data.x) / w.batch_size)
        default_steps = w.epochs * per_epoch
        entry = {"kind": model_kind(w.model()), "workload_kind": w.kind, "metric": w.metric, "default_steps": default_steps,
                 "target": w.target, "lengths": {}}
        one_run(w, data, "adamw", 99, min(20, default_steps))  # warm-up: the process's one-time costs, untimed
        for frac in fracs:
            steps = max(8, round(frac * default_steps))
            rows = []
            for seed in range(a.first_seed, a.first_seed + a.seeds):
                order = list(cands)
                rng.shuffle(order)
                for cand in order:
                    r = one_run(w, data, cand, seed, steps)
                    rows.append({"cand": cand, "seed": seed, **r})
                    print(f"{w.name} steps={steps} seed={seed} {cand}: {w.metric} {r['metric']:.4f} "
                          f"{r['seconds']:.2f}s", flush=True)
            entry["lengths"][str(steps)] = {"frac": frac, "runs": rows, "summary": summarize(rows, w)}
            result["workloads"][w.name] = merged(entry, earlier, w) if earlier else entry
            result["wall_s"] = round(time.perf_counter() - t_all, 1)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out + ".tmp").write_text(json.dumps(result, indent=1))
            os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
