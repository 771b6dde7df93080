"""Time to accuracy: how long `naive` and `all` train until validation accuracy reaches a target.

The throughput table (runner.py) says how fast one step is; this says whether the speed
survives to the result. `all` is torchspeed's automatic choice (`TrainConfig()` defaults):
autocast in the precision this device runs fast (T21), channels_last (T23), torch.compile
where a measured trial pays and the run is long enough to pay back the compilation (T25),
fused optimizer kernels (T18), the loss read every 50 steps instead of every step (T13),
`zero_grad(set_to_none=True)` (T26), and on GPUs the side-stream prefetcher and
cudnn.benchmark (T07, T12, T22). `naive` (`TrainConfig.naive()`) switches all of them off. A
speed-up that costs accuracy (a precision that learns slower, say) shows up here as more
steps to the target.

Method:
- **Same recipe.** Per seed both configs start from the same initial weights and see the
  same batches in the same order; both train with SGD (momentum 0.9, weight decay 5e-4)
  under the same one-cycle schedule (T14) over the same fixed step budget, same batch size
  and peak learning rate. Only the speed switches differ. Their float rounding differs too
  (channels_last and fused kernels sum in another order), and training amplifies it, so per
  seed the two runs need not take the same number of steps; the seeds average that out.
- **A step budget caps every run.** The run stops at the first evaluation at or above the
  target, or when the budget is spent; a target never reached is reported as not reached
  (time and steps None) with the accuracy the run ended at, never as an endless loop.
- **The clock runs around the training steps only** (synced on GPUs): data loading, the
  compile="auto" trial and any compilation count; evaluation does not. On short runs
  compile="auto" keeps `all` eager without compiling (its short-run rule, train/compile.py).
- **Evaluation every `eval_every` optimizer steps** on the whole validation set. By default
  the model trains on as many samples between two evaluations as the validation set holds; a
  forward costs about a third of a training step, so evaluation adds about a third to the wall
  time and nothing to the measurement. Steps to target are multiples of `eval_every` (or the
  budget).
- **Seeds interleaved, one process per run.** naive seed 0, all seed 0, naive seed 1, ...,
  so slow drifts of a shared machine hit both alike. Each run is a fresh process started the
  way the throughput bench starts that config (its allocator, e.g. tcmalloc for `all` where
  installed, its OpenMP wait policy, passive for `all` on a busy CPU), with its own thread pool
  and compile cache.
- **Reported per config:** mean, min, max, standard deviation and median over seeds of the
  time and steps to target and of the final val_acc, how many seeds reached the target, and
  the speed-up: naive's mean time over all's (only when every seed of both reached the
  target), with the per-seed ratios and their median (robust to a burst of other work on a
  shared machine, which the mean is not).

Here "tta" stands for time to accuracy, not test-time augmentation (`TrainConfig.tta`, T33).

Example:
    >>> res = run_tta(model="resnet20", data="digits", target=0.9, seeds=3)
    >>> res.summary["all"]["time_to_target_s"]["mean"], res.speedup
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from torchspeed.bench.compare import compare_ratios, describe_comparison

__all__ = ["DEFAULT_TARGETS", "DEFAULT_MAX_STEPS", "DEFAULT_LR", "TTARun", "TTAResult", "resolve_target", "run_tta",
           "attach_tta", "print_tta", "train_to_target"]

# The target `torchspeed bench --data NAME` aims at when --target-acc is not given (no entry: off).
# ResNet-20 at batch 64 reaches 0.90 on the digits in 56-72 of the 80 steps of the default one-cycle
# (measured over 3 seeds x naive/all; 0.95-0.97 at that point).
DEFAULT_TARGETS = {"digits": 0.90}
# The step budget when not given: the one-cycle schedule's length, and where a run gives up.
DEFAULT_MAX_STEPS = 80
DEFAULT_LR = 0.1  # the one-cycle's peak learning rate (SGD, momentum 0.9)
CONFIGS = ("naive", "all")


@dataclass
class TTARun:
    """One config, one seed."""

    config: str
    seed: int
    reached: bool
    time_to_target_s: float | None   # training seconds until the first evaluation >= target (None: not reached)
    steps_to_target: int | None
    val_acc: float                   # at that evaluation, or at the end of the budget when not reached
    steps: int                       # optimizer steps trained
    train_s: float                   # training seconds over all of them
    max_steps: int
    eval_every: int
    curve: list = field(default_factory=list)  # [step, training seconds, val_acc] at each evaluation
    decisions: dict = field(default_factory=dict)


@dataclass
class TTAResult:
    target: float
    seeds: list[int]
    max_steps: int
    eval_every: int
    runs: list[TTARun]
    summary: dict                    # per config: reached, time_to_target_s / steps_to_target / val_acc stats
    speedup: float | None            # naive mean time / all mean time (every seed of both reached)
    speedup_runs: list = field(default_factory=list)  # per seed, where both reached
    meta: dict = field(default_factory=dict)

    def message(self) -> str | None:
        """A sentence for configs that missed the target on some seed (None when all reached it)."""
        missed = [f"{c} {s['reached']}/{len(self.seeds)} seeds" for c, s in self.summary.items()
                  if s["reached"] < len(self.seeds)]
        if not missed:
            return None
        return (f"target val_acc {self.target:g} not reached within {self.max_steps} steps by: "
                + ", ".join(missed) + " (reported as None; lower --target-acc or raise --tta-steps)")

    def to_dict(self) -> dict:
        interval = compare_ratios(self.speedup_runs) if self.speedup_runs else None
        return {"target": self.target, "seeds": self.seeds, "max_steps": self.max_steps,
                "eval_every": self.eval_every, "summary": self.summary, "speedup_naive_over_all": self.speedup,
                "speedup_runs": self.speedup_runs,
                "speedup_median": interval["median"] if interval else None,
                "speedup_interval": interval,
                "message": self.message(), "meta": self.meta,
                "runs": [asdict(r) for r in self.runs]}


def resolve_target(data: str, target_acc: float | None, *, off: bool = False) -> float | None:
    """The target accuracy to run for, or None (off): given, the dataset's default, or off."""
    if off:
        return None
    if target_acc is None:
        return DEFAULT_TARGETS.get(data)
    if not 0.0 <= target_acc <= 1.0:
        raise ValueError(f"--target-acc must be a validation accuracy between 0 and 1 (e.g. 0.9 for 90%), "
                         f"got {target_acc:g}; 0 switches time to accuracy off")
    return target_acc or None


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "median": statistics.median(values)}


def _summary(runs: list[TTARun], config: str) -> dict:
    mine = [r for r in runs if r.config == config]
    hit = [r for r in mine if r.reached]
    return {"reached": len(hit), "seeds": len(mine),
            # times and steps: over the seeds that reached the target (see `reached`)
            "time_to_target_s": _stats([r.time_to_target_s for r in hit]),
            "steps_to_target": _stats([float(r.steps_to_target) for r in hit]),
            "val_acc": _stats([r.val_acc for r in mine]),
            "decisions": mine[0].decisions if mine else {}}


def run_tta(*, model: str = "resnet20", data: str = "digits", target: float, seeds: int = 3, seed: int = 0,
            batch_size: int = 64, lr: float = DEFAULT_LR, max_steps: int | None = None,
            eval_every: int | None = None, device: str | None = None, compile: bool = True,
            train_size: int | None = None, val_size: int | None = None, image_size: int = 32,
            busy: bool | None = None, progress: bool = True) -> TTAResult:
    """Train naive and all to `target` val_acc on `seeds` seeds, interleaved, each run in its own process.

    `max_steps` (None: DEFAULT_MAX_STEPS) is the one-cycle schedule's length and the most a run
    trains; `lr` is its peak. `eval_every` None: the validation set's size in training samples.
    `busy`: whether other jobs share the cores, which decides how `all` starts (runner.bench_configs);
    None measures it (CPU), as the throughput bench does; pass the throughput bench's answer to match it.
    """
    import torch

    from torchspeed.bench.runner import bench_configs, machine_busy, provenance
    from torchspeed.env import default_device

    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be a validation accuracy in (0, 1], got {target}")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    for name, v in (("max_steps", max_steps), ("eval_every", eval_every), ("batch_size", batch_size)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be positive, got {v}")
    max_steps = max_steps or DEFAULT_MAX_STEPS
    dev = default_device(device or None)
    if busy is None:
        busy = machine_busy()[0] if dev.type == "cpu" else False
    chosen = {c.name: c for c in bench_configs(dev, compile=compile, hand=False, busy=busy) if c.name in CONFIGS}
    if train_size is None:
        train_size = 2048 if image_size < 64 else 4 * batch_size
    if val_size is None:
        val_size = 1024 if image_size < 64 else 2 * batch_size
    base = {"model": model, "data": data, "batch_size": batch_size, "train_size": train_size, "val_size": val_size,
            "lr": lr, "data_seed": seed, "device": str(dev), "image_size": image_size, "target": target,
            "max_steps": max_steps, "eval_every": eval_every}
    seed_list = [seed + i for i in range(seeds)]

    from rich.progress import Progress

    runs: list[TTARun] = []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("time to accuracy", total=len(seed_list) * len(CONFIGS))
        for s in seed_list:
            for name in CONFIGS:
                bar.update(task, description=f"time to accuracy {target:g}: {name}, seed {s}")
                runs.append(_run_process(chosen[name], base | {"seed": s}))
                bar.advance(task)
    summary = {name: _summary(runs, name) for name in CONFIGS}
    by = {(r.config, r.seed): r for r in runs}
    pairs = [(by["naive", s], by["all", s]) for s in seed_list]
    ratios = [n.time_to_target_s / a.time_to_target_s for n, a in pairs if n.reached and a.reached]
    every = all(summary[c]["reached"] == len(seed_list) for c in CONFIGS)
    speedup = (summary["naive"]["time_to_target_s"]["mean"] / summary["all"]["time_to_target_s"]["mean"]
               if every else None)
    meta = provenance() | {"model": model, "data": data, "batch_size": batch_size, "lr_peak": lr,
                           "schedule": "onecycle", "optimizer": "SGD momentum 0.9, weight decay 5e-4",
                           "image_size": image_size, "train_size": runs[0].decisions.get("train_samples"),
                           "val_size": runs[0].decisions.get("val_samples"), "torch_threads": torch.get_num_threads(),
                           "busy": busy}
    return TTAResult(target=target, seeds=seed_list, max_steps=runs[0].max_steps, eval_every=runs[0].eval_every,
                     runs=runs, summary=summary, speedup=speedup, speedup_runs=ratios, meta=meta)


def attach_tta(result, tta: TTAResult) -> None:
    """Put the time-to-accuracy numbers on the naive and all rows of a BenchResult and add its `tta` section."""
    for row in result.rows:
        s = tta.summary.get(row.config)
        if s is None:
            continue
        mine = [r for r in tta.runs if r.config == row.config]
        every = s["reached"] == s["seeds"]
        row.rounds_val_acc = row.val_acc
        row.val_acc = s["val_acc"]["mean"]
        row.time_to_target_s = s["time_to_target_s"]["mean"] if every else None
        row.steps_to_target = s["steps_to_target"]["mean"] if every else None
        row.time_to_target_s_runs = [r.time_to_target_s for r in mine]
        row.steps_to_target_runs = [r.steps_to_target for r in mine]
        row.val_acc_runs = [r.val_acc for r in mine]
    result.tta = tta.to_dict()


def print_tta(console, tta: TTAResult) -> None:
    """The "time to accuracy" table: per config, mean [min-max] over seeds; then the naive/all ratio."""
    from rich.table import Table

    m = tta.meta
    table = Table(title=f"time to accuracy: val_acc >= {tta.target:g} ({m.get('model')} on {m.get('data')}, "
                        f"batch {m.get('batch_size')}, {len(tta.seeds)} seeds, one-cycle over {tta.max_steps} "
                        f"steps, evaluated every {tta.eval_every}; evaluation off the clock)")
    for col in ("config", "reached", "time to target (s)", "steps to target", "val acc", "speed-up"):
        table.add_column(col, justify="left" if col == "config" else "right")

    def cell(stats: dict | None, fmt: str) -> str:
        if stats is None:
            return "not reached"
        return f"{stats['mean']:{fmt}} [{stats['min']:{fmt}}-{stats['max']:{fmt}}]"

    for name, s in tta.summary.items():
        speed = "1.00x" if name == "naive" else "-" if tta.speedup is None else f"{tta.speedup:.2f}x"
        table.add_row(name, f"{s['reached']}/{s['seeds']}", cell(s["time_to_target_s"], ".1f"),
                      cell(s["steps_to_target"], ".0f"), cell(s["val_acc"], ".3f"), speed,
                      style="bold red" if name == "all" else None)
    console.print(table)
    if tta.message():
        console.print(f"[yellow]{tta.message()}[/]")
    elif tta.speedup is not None:
        cmp = compare_ratios(tta.speedup_runs)
        console.print(f"[bold]time to accuracy: all {tta.speedup:.2f}x naive[/] (naive's mean time over all's; "
                      "per seed: " + ", ".join(f"{r:.2f}x" for r in tta.speedup_runs)
                      + f"; median {cmp['median']:.2f}x): "
                      + describe_comparison(cmp, candidate="all", baseline="naive") + f" in time to {tta.target:g}")


# ---------------------------------------------------------------------- one run, in its own process
def _run_process(cfg, spec: dict) -> TTARun:
    from torchspeed.bench._worker import PREFIX
    from torchspeed.bench.runner import config_env

    spec = spec | {"config": cfg.name, "train": asdict(replace(cfg.train, schedule="onecycle")),
                   "num_workers": cfg.num_workers}
    proc = subprocess.run([sys.executable, "-m", "torchspeed.bench.tta"], input=json.dumps(spec) + "\n",
                          capture_output=True, text=True, env=config_env(cfg))
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            reply = json.loads(line[len(PREFIX):])
            if not reply.get("ok"):
                raise RuntimeError(f"time to accuracy, config {cfg.name!r} seed {spec['seed']} failed: "
                                   f"{reply.get('error')}\n{reply.get('traceback', '')}")
            return TTARun(**reply["run"])
    tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
    raise RuntimeError(f"time to accuracy, config {cfg.name!r} seed {spec['seed']}: its process exited "
                       f"(code {proc.returncode})\n{tail}")


def train_to_target(spec: dict) -> TTARun:
    """Train one config from `spec` until val_acc >= spec['target'] or the step budget is spent."""
    from torchspeed.bench._worker import _data, _model
    from torchspeed.env import allocator_in_use
    from torchspeed.train.trainer import Trainer, TrainConfig

    loader, val_loader, device = _data(spec)
    steps_per_epoch = len(loader)
    if steps_per_epoch < 1:
        raise ValueError(f"the training set has fewer samples than one batch of {spec['batch_size']}")
    max_steps = spec.get("max_steps") or DEFAULT_MAX_STEPS
    eval_every = spec.get("eval_every") or max(1, math.ceil(len(val_loader.dataset) / spec["batch_size"]))
    cfg = replace(TrainConfig(**spec["train"]), max_steps=max_steps, grad_accum=1)
    trainer = Trainer(_model(spec), optimizer="sgd", lr=spec["lr"], device=device, config=cfg)
    trainer.setup_schedule(None, 1)     # one-cycle over max_steps optimizer steps
    trainer.compiler.plan(max_steps)    # compile="auto": its short-run rule sees the whole budget

    def batches():
        while True:
            yield from trainer.batches(loader)

    t0 = time.perf_counter()
    trainer.prepare(loader, remaining_steps=max_steps)  # what fit() does first; its time counts
    it, clock, curve = batches(), time.perf_counter() - t0, []
    reached_at = None
    while trainer.step < max_steps:
        clock += trainer.run_steps(it, min(eval_every, max_steps - trainer.step))  # synced
        acc = trainer.evaluate(val_loader)["val_acc"]                              # off the clock
        if acc is None:
            raise ValueError(f"model {spec['model']!r} on {spec['data']!r} reports no accuracy: time to "
                             "accuracy needs a classification workload")
        curve.append([trainer.step, clock, acc])
        if acc >= spec["target"]:
            reached_at = curve[-1]
            break
    decisions = {k: str(v) for k, v in trainer.decisions.items()}
    decisions |= {"allocator": allocator_in_use(), "num_workers": loader.num_workers,
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (spin, then sleep)"),
                  "train_samples": len(loader.dataset), "val_samples": len(val_loader.dataset)}
    last = curve[-1]
    return TTARun(config=spec["config"], seed=spec["seed"], reached=reached_at is not None,
                  time_to_target_s=reached_at[1] if reached_at else None,
                  steps_to_target=reached_at[0] if reached_at else None, val_acc=last[2], steps=last[0],
                  train_s=last[1], max_steps=max_steps, eval_every=eval_every, curve=curve, decisions=decisions)


def main() -> int:
    from torchspeed.bench._worker import _reply

    spec = json.loads(sys.stdin.readline())
    try:
        t0 = time.perf_counter()
        run = train_to_target(spec)
        _reply({"ok": True, "run": asdict(run), "process_s": time.perf_counter() - t0})
    except Exception as e:  # reported to the parent, which names the config and seed that failed
        import traceback

        _reply({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
