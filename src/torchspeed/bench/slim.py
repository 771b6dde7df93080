"""`torchspeed bench --slim`: smaller models, measured as time and accuracy on 4 workloads (T38).

Not part of `make bench`. The workloads (bench/slim_workloads.py): ResNet-20 on the digits at 32 px and the
suite's digits CNN at 8 px (prune and distil rows); a CNN and a small Vision Transformer on digit pairs, 100
classes (distil rows, the teacher trained first). For each workload and seed:

- **prune**: the full model trained with `fit` for `epochs`; `torchspeed.slim(ratio=0.5)` on it (the
  train step and the latency of a 64-image and a 1-image batch, fp32 eager, timed side by side with the
  original); `finetune` for at most `FINETUNE_SHARE` of the full run's steps; and the pruned
  architecture trained from scratch with the full run's settings. Each run's time to the full model's
  final accuracy less one point is its training seconds (`epoch_s`, evaluation out) up to the first
  epoch at or above it.
- **distil**: a student a quarter of the teacher's width (the trained full model is the teacher) from
  scratch for `epochs`, and distilled (`fit(..., teacher=...)`, the cache as measured) for `PAYS` of
  them (its schedule annealed over its own, shorter run: a run as long as the scratch one peaks at its
  end whatever it learns on the way, so it cannot say whether a shorter one would do); the distilled
  student's seconds to the scratch student's final accuracy, the teacher's seconds in (its cache pass
  and the measurement that chose it; per-step forwards are inside the steps), over the scratch
  student's. A run's seconds to the target are its epochs to it times an epoch's seconds timed side by
  side (`_pace`: one-epoch runs with and without the teacher, alternated, after an untimed round), so the
  ratio does not move with the machine's pace between the runs; the runs' own seconds are in the JSON too.
  The same shorter run without the teacher is the control: distillation pays where the distilled student
  gets there in 0.7x or less of the scratch run's seconds, and sooner than the control where the control
  gets there too (else it is the budget, not the teacher); the row says which, with the numbers.

Example:
    >>> result = run_slim_bench(seeds=(0,), epochs=15)
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.bench.runner import provenance
from torchspeed.bench.slim_workloads import SLIM_WORKLOADS
from torchspeed.distill import Teacher
from torchspeed.fitting import fit
from torchspeed.slimming import SlimResult, finetune, measure_models, slim
from torchspeed.train.rounds import interleaved

__all__ = ["FINETUNE_SHARE", "PAYS", "PACE_ROUNDS", "run_slim_bench", "slim_table"]

FINETUNE_SHARE = 0.2   # the fine-tune's steps, as a share of the full run's
PAYS = 0.7             # a distilled student pays at this share of the scratch student's seconds, or less
PACE_ROUNDS = 3        # interleaved one-epoch rounds a side that price an epoch of the distil rows' runs
BATCH = 64
# Every run alike: no switch trial (its first-steps turns would weigh differently on a 4-epoch and a 15-epoch run;
# precision is the hardware rule's), no compile (its seconds on 2 cores would dwarf a small model's run).
FIT_OPTIONS = {"progress": False, "trial": False, "compile": False}


def _run(model: nn.Module, train, val, *, seed: int, epochs: int, **options) -> dict:
    """One `fit` run: its final val_acc, steps, wall seconds and per-epoch (cumulative training seconds, val_acc)."""
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(TensorDataset(*train), batch_size=BATCH, shuffle=True, generator=g)
    val_loader = DataLoader(TensorDataset(*val), batch_size=256)
    t0 = time.perf_counter()
    r = options.pop("runner", fit)(model, loader, val_loader=val_loader, epochs=epochs, **FIT_OPTIONS, **options)
    wall = time.perf_counter() - t0
    cum, curve = 0.0, []
    for row in r.history:
        cum += row["epoch_s"]
        curve.append([round(cum, 3), row.get("val_acc")])
    out = {"val_acc": r.final.get("val_acc"), "steps": r.steps, "wall_s": round(wall, 3), "curve": curve}
    if "distill" in r.decisions:
        d = r.decisions["distill"]
        m = d.measured or {}
        out["distill"] = {"cache": d.value, "reason": d.reason, **m}
        out["teacher_s"] = round(m.get("cache_s", 0.0) + m.get("decide_s", 0.0), 3)
    return out


def _pace(student: nn.Module, train, val, *, seed: int, teacher: nn.Module, cache) -> dict:
    """An epoch's training seconds without the teacher and with it (its cache as the distilled run decided):
    one-epoch runs of fresh copies of the untrained `student`, the two alternated for PACE_ROUNDS rounds after one
    untimed round (`rounds.interleaved`); the medians. The distil rows' runs follow one another, so a machine that
    slows down or speeds up between them moves their seconds' ratio; an epoch priced side by side does not."""
    def epoch(way: str) -> float:
        options = {"teacher": Teacher(teacher, cache=cache)} if way == "distilled" else {}
        return _run(copy.deepcopy(student), train, val, seed=seed, epochs=1, **options)["curve"][0][0]
    rounds = interleaved({way: functools.partial(epoch, way) for way in ("scratch", "distilled")},
                         rounds=PACE_ROUNDS, warmup=1, order="alternate")
    return {way: round(t, 4) for way, t in rounds.medians().items()}


def _seconds_to(run: dict, target: float, epoch_s: float | None = None) -> float | None:
    """Training seconds (plus the teacher's up-front seconds) to the first epoch at or above `target`: the run's
    own, or with `epoch_s` (an epoch's seconds as `_pace` timed it) the epochs to it times that."""
    for epochs, (seconds, acc) in enumerate(run["curve"], 1):
        if acc is not None and acc >= target:
            return round((seconds if epoch_s is None else epochs * epoch_s) + run.get("teacher_s", 0.0), 3)
    return None


def _teacher(name: str, seed: int, epochs: int) -> tuple[nn.Module, dict]:
    """The workload's full model trained with `fit` for `epochs`, and its run."""
    train, val = SLIM_WORKLOADS[name].data(seed)
    torch.manual_seed(seed)
    full = SLIM_WORKLOADS[name].full()
    return full, _run(full, train, val, seed=seed, epochs=epochs)


def _prune_rows(name: str, seed: int, epochs: int) -> tuple[dict, nn.Module]:
    train, val = SLIM_WORKLOADS[name].data(seed)
    full, full_run = _teacher(name, seed, epochs)
    x, y = train
    vx = val[0]
    t0 = time.perf_counter()
    res = slim(full, vx[:BATCH], ratio=0.5, batches=[(x[:BATCH], y[:BATCH])],
               val_loader=DataLoader(TensorDataset(*val), batch_size=256))
    slim_s = time.perf_counter() - t0
    one = measure_models({"original": full, "pruned": res.model}, vx[:1])
    steps = max(1, math.floor(FINETUNE_SHARE * full_run["steps"]))
    pruned = copy.deepcopy(res.model)  # the same pruned weights for the fine-tune with the full model as teacher
    ft = _run(res.model, train, val, seed=seed, epochs=epochs, max_steps=steps, runner=_finetuner(res))
    ft_kd = _run(pruned, train, val, seed=seed, epochs=epochs, max_steps=steps, teacher=Teacher(full),
                 runner=_finetuner(SlimResult(pruned, copy.deepcopy(res.report))))  # finetune's LR rule, distilled
    torch.manual_seed(seed)
    scratch = copy.deepcopy(res.model)
    for m in scratch.modules():
        if hasattr(m, "reset_parameters") and m is not scratch:
            m.reset_parameters()
    scratch_run = _run(scratch, train, val, seed=seed, epochs=epochs)
    target = round(full_run["val_acc"] - 0.01, 4)
    report = res.report.to_dict()
    row = {"workload": name, "seed": seed, "epochs": epochs, "target": target, "full": full_run,
           "slim": {k: report[k] for k in ("ratio", "params", "macs", "step_s", "latency_s", "step_speedup",
                                          "latency_speedup", "accuracy", "recovered", "widths")},
           "slim_s": round(slim_s, 3), "latency_batch1": {"original_s": one["original"]["latency_s"],
                                                          "pruned_s": one["pruned"]["latency_s"],
                                                          "speedup": one["pruned"]["latency_speedup"]},
           "finetune": {**ft, "max_steps": steps, "share": round(steps / full_run["steps"], 3)},
           "finetune_distilled": ft_kd, "pruned_scratch": scratch_run}
    row["finetune_within_1pt"] = ft["val_acc"] is not None and ft["val_acc"] >= target
    row["finetune_distilled_within_1pt"] = ft_kd["val_acc"] is not None and ft_kd["val_acc"] >= target
    row["seconds_to_target"] = {"full": _seconds_to(full_run, target),
                                "pruned_scratch": _seconds_to(scratch_run, target),
                                "full_then_slim_finetune": None if _seconds_to(ft, target) is None else round(
                                    full_run["curve"][-1][0] + slim_s + _seconds_to(ft, target), 3)}
    return row, full


def _finetuner(res):
    def run(model, loader, **options):
        return finetune(res, loader, **options)
    return run


def _distil_rows(name: str, seed: int, epochs: int, teacher: nn.Module) -> dict:
    train, val = SLIM_WORKLOADS[name].data(seed)
    torch.manual_seed(seed + 1)
    student = SLIM_WORKLOADS[name].student()
    twin, control, init = (copy.deepcopy(student) for _ in range(3))  # the same initial weights for all
    short = max(1, round(epochs * PAYS))
    scratch = _run(student, train, val, seed=seed, epochs=epochs)
    distilled = _run(twin, train, val, seed=seed, epochs=short, teacher=Teacher(teacher))
    short_scratch = _run(control, train, val, seed=seed, epochs=short)
    target = scratch["val_acc"]
    pace = _pace(init, train, val, seed=seed, teacher=teacher, cache=distilled.get("distill", {}).get("cache", "auto"))
    a, b, c = (_seconds_to(r, target, pace[way]) for r, way in
               ((scratch, "scratch"), (distilled, "distilled"), (short_scratch, "scratch")))
    ratio, vs_control, pays, verdict = _distil_verdict(a, b, c, short, target)
    return {"workload": name, "seed": seed, "epochs": epochs, "short_epochs": short, "target": target,
            "scratch": scratch, "distilled": distilled, "short_scratch": short_scratch,
            "epoch_s": pace, "seconds_to_target": {"scratch": a, "distilled": b, "short_scratch": c},
            "seconds_to_target_as_run": {way: _seconds_to(r, target) for way, r in (
                ("scratch", scratch), ("distilled", distilled), ("short_scratch", short_scratch))},
            "ratio": ratio, "vs_control": vs_control, "pays": pays, "verdict": verdict}


def _distil_verdict(a: float | None, b: float | None, c: float | None, short: int, target: float):
    """(ratio, vs_control, pays, verdict) from the seconds to `target` of the scratch run (`a`), the distilled run
    (`b`) and the control (`c`, the distilled run's budget without the teacher; None: never got there). Pays: the
    distilled student gets there in PAYS of the scratch run's seconds or less, and sooner than the control where
    the control gets there too (else the shorter budget, not the teacher, is what bought the time). `vs_control`
    says how much of the gain is the teacher's."""
    ratio = None if a is None or b is None else round(b / a, 3)
    vs_control = None if b is None or c is None else round(b / c, 3)
    if ratio is None:
        return ratio, vs_control, False, f"does not pay: the distilled student never reached {target} in {short} epochs"
    if ratio > PAYS:
        return ratio, vs_control, False, f"does not pay: {ratio}x the scratch student's seconds (needs {PAYS}x or less)"
    if vs_control is not None and vs_control >= 1.0:
        return ratio, vs_control, False, (f"does not pay: {short} epochs reach {target} without the teacher too "
                                          f"({ratio}x with it, {vs_control}x the run without it)")
    control = (f"without the teacher {short} epochs do not reach {target}" if c is None else
               f"{vs_control}x the seconds of the same {short}-epoch run without the teacher")
    return ratio, vs_control, True, f"pays: {ratio}x the scratch student's seconds; {control}"



def run_slim_bench(*, workloads: tuple[str, ...] = tuple(SLIM_WORKLOADS), seeds: tuple[int, ...] = (0,),
                   epochs: int = 15, log: Callable[[str], object] | None = None) -> dict:
    """Every workload and seed: the prune rows, then the distil rows on the trained full model as teacher."""
    log = log or (lambda line: print(line, flush=True))
    unknown = [w for w in workloads if w not in SLIM_WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}: use {sorted(SLIM_WORKLOADS)}")
    prune, distil = [], []
    t0 = time.perf_counter()
    for name in workloads:
        for seed in seeds:
            if SLIM_WORKLOADS[name].prune:
                row, teacher = _prune_rows(name, seed, epochs)
                prune.append(row)
                log(f"{name} seed {seed}: prune 0.5 step {row['slim']['step_speedup']:.2f}x latency "
                    f"{row['slim']['latency_speedup']:.2f}x, fine-tune {row['finetune']['val_acc']:.4f} "
                    f"vs full {row['full']['val_acc']:.4f}")
            else:
                teacher, teacher_run = _teacher(name, seed, epochs)
                log(f"{name} seed {seed}: teacher {teacher_run['val_acc']:.4f} in {teacher_run['wall_s']} s")
            distil.append(_distil_rows(name, seed, epochs, teacher))
            if not SLIM_WORKLOADS[name].prune:
                distil[-1]["teacher"] = teacher_run
            log(f"{name} seed {seed}: distil {distil[-1]['verdict']}")
    return {"meta": {**provenance(), "fit_options": FIT_OPTIONS, "epochs": epochs, "seeds": list(seeds), "batch_size": BATCH,
                     "finetune_share": FINETUNE_SHARE, "pays_at": PAYS, "seconds": round(time.perf_counter() - t0, 1)},
            "prune": prune, "distil": distil, "summary": _summary(prune, distil)}


def _summary(prune: list[dict], distil: list[dict]) -> dict:
    """Per workload, medians over seeds; the prune figures are None where only the distillation rows ran."""
    out = {}
    med = (lambda xs: round(statistics.median(xs), 4) if xs else None)  # noqa: E731
    for name in dict.fromkeys(r["workload"] for r in prune + distil):
        p = [r for r in prune if r["workload"] == name]
        d = [r for r in distil if r["workload"] == name]
        out[name] = {"step_speedup": med([r["slim"]["step_speedup"] for r in p]),
                     "latency_speedup": med([r["slim"]["latency_speedup"] for r in p]),
                     "latency_speedup_batch1": med([r["latency_batch1"]["speedup"] for r in p]),
                     "full_acc": med([r["full"]["val_acc"] for r in p] or [r["teacher"]["val_acc"] for r in d]),
                     "finetune_acc": med([r["finetune"]["val_acc"] for r in p]),
                     "finetune_within_1pt": all(r["finetune_within_1pt"] for r in p) if p else None,
                     "finetune_distilled_acc": med([r["finetune_distilled"]["val_acc"] for r in p]),
                     "finetune_distilled_within_1pt": all(r["finetune_distilled_within_1pt"] for r in p) if p else None,
                     "student_acc": med([r["scratch"]["val_acc"] for r in d]),
                     "distil_ratio": med([r["ratio"] for r in d if r["ratio"] is not None]),
                     "distil_pays": bool(d) and all(r["pays"] for r in d)}
    return out


def slim_table(result: dict) -> str:
    """Markdown: one row per workload (medians over seeds), as docs/slim.md shows it; `-` where a row did not run."""
    def x(v, fmt="{:.2f}x"):
        return "-" if v is None else fmt.format(v)
    rows = ["| workload | step speed-up | latency speed-up (64 / 1) | full acc | fine-tuned acc (<= 20% steps; with "
            "the full model as teacher) | scratch student acc | distilled / scratch seconds |",
            "|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        acc = "{:.4f}"
        tuned = "-" if s["finetune_acc"] is None else \
            f"{s['finetune_acc']:.4f}; {x(s.get('finetune_distilled_acc'), acc)}"
        rows.append(f"| {name} | {x(s['step_speedup'])} | {x(s['latency_speedup'])} / "
                    f"{x(s['latency_speedup_batch1'])} | {x(s['full_acc'], acc)} | {tuned} | "
                    f"{x(s.get('student_acc'), acc)} | "
                    f"{s['distil_ratio']}x ({'pays' if s['distil_pays'] else 'does not pay'}) |")
    return "\n".join(rows)
