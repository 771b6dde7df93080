"""Time to accuracy, measured as record runs are: the shortest step budget that reaches the target on every seed.

The throughput table (runner.py) says how fast one step is; this says how soon the trained
model is there. The configs:

- `naive`: today's recipe (SGD momentum 0.9, weight decay 5e-4, one-cycle with a fixed peak
  LR of 0.1), speed switches off (`TrainConfig.naive()`);
- `all`: the same recipe, torchspeed's speed switches on (`TrainConfig()` defaults: the
  measured switch trial, fused kernels, T13 host reads, ...);
- `auto`: the speed switches on plus the recipe `fit(recipe="auto")` chooses on the training
  data (plan/recipe.py: peak LR and floor from the range test, label smoothing, BatchNorm
  statistics of the final weights, flip TTA only where it scores better, Schedule-Free AdamW as
  the optimizer prior of short runs, ...), from an empty cache, choosing counted;
- `auto_warm`: the same, reading the cache an earlier run left (measured off the clock);
- `schedulefree`: the switches of `all`, Schedule-Free AdamW at its defaults, no schedule.

Method (why a budget grid): a one-cycle run's accuracy at step k depends on the schedule's
length, so "the first evaluation above the target" rewards a long schedule caught mid-way.
Record runs (airbench, the CIFAR-10 speedruns) instead fix the schedule and report the
shortest one that ends at the target. So, for each config: train complete runs of a budget
from the grid `BUDGETS` (the one-cycle's length in optimizer steps), evaluate once at the
end, and find the shortest budget whose run ends at or above the target on every seed (a
search over the grid: a budget is rejected as soon as one seed misses, so most rejected
budgets cost one run). Reported per config and target: that budget, the samples it trains
(budget x batch), the training time (mean over seeds of the run at that budget; the switch
trial, any compilation and the preparation of the weights evaluation looks through count:
Schedule-Free's average with its BatchNorm statistics recalibrated; evaluation does not), the tuning time (auto: choosing the
recipe, once per seed, in its own process), and the final accuracy per seed. From these,
the speed-ups against `all` (samples, training time, and tuning included) and the
break-even: the run length (in `all`'s training seconds) beyond which auto's tuning has paid
for itself.

- Nothing of the recipe reads the validation split: it is chosen on training batches alone.
- Seeds change the initial weights and the batch order; every config sees the same ones.
- Each run is a fresh process of `bench/time_to_target_worker.py`, started the way the
  throughput bench starts that config (allocator, OpenMP settings); the tables print in
  `cli/bench_run.py`.
- The search assumes a budget that passes stays passing when it grows (true of these curves
  up to noise); it reports the budgets it tried and the final accuracy of every run.
- `ablation=True`: a leave-one-out (or add-one) row per recipe part, and the budget it needs.
Example:
    >>> res = run_time_to_target(model="resnet20", data="digits", targets=(0.97, 0.90), seeds=3)
    >>> res.targets[0]["configs"]["auto"]["budget_steps"]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace

from torchspeed.bench._protocol import read_reply
from torchspeed.bench.config_process import config_env
from torchspeed.bench.runner import bench_configs, machine_busy, provenance
from torchspeed.bench.tta_table import target_entries
from torchspeed.env import default_device
from torchspeed.plan.parts import PARTS
from torchspeed.train.optim import SCHEDULE_FREE_LR
from torchspeed.train.loop.progress import progress_bar

__all__ = ["DEFAULT_TARGETS", "BUDGETS", "CONFIGS", "TTARun", "TTAResult", "resolve_targets", "run_time_to_target",
           "attach_time_to_target", "shortest_budget"]

# Targets per dataset, fixed before any tuning: the digits at 0.97, and 0.90 to compare with earlier results.
DEFAULT_TARGETS = {"digits": (0.97, 0.90)}
BUDGETS = (8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 96, 112, 128, 160, 192, 256, 320, 400)  # one-cycle lengths
START = 80          # where the search starts for naive/all (today's default budget)
DEFAULT_LR = 0.1    # today's recipe: the one-cycle's peak LR (SGD, momentum 0.9)
CONFIGS = ("naive", "all", "auto", "auto_warm", "schedulefree")
SF_LR = SCHEDULE_FREE_LR  # Schedule-Free AdamW's own default LR: what a user who wants no tuning runs


@dataclass
class TTARun:
    """One complete run: one config, one seed, one step budget."""

    config: str
    seed: int
    budget: int                  # optimizer steps (the one-cycle's length)
    val_acc: float | None        # at the end
    val_loss: float
    train_s: float               # training seconds (the clock around the steps, the switch trial's in; evaluation out)
    samples: int
    decisions: dict = field(default_factory=dict)
    tuning_s: float = 0.0        # choosing the recipe in the run's own process, before training (auto)
    tuning_steps: int = 0        # training steps off the run that choosing spent
    phases: dict = field(default_factory=dict)  # where train_s went (the worker's _Keep.phases)

    @property
    def total_s(self) -> float:
        return self.train_s + self.tuning_s


@dataclass
class TTAResult:
    targets: list                # one entry per (workload, target): see `_target_entry`
    runs: list[TTARun]
    recipes: dict                # seed -> the recipe the warm cache holds (measured with no budget, off the clock)
    seeds: list[int]
    meta: dict = field(default_factory=dict)
    ablation: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"targets": self.targets, "ablation": self.ablation, "seeds": self.seeds, "meta": self.meta,
                "recipes": self.recipes, "runs": [asdict(r) for r in self.runs]}


def resolve_targets(data: str, target_acc: float | None, *, off: bool = False) -> tuple[float, ...]:
    """The targets to run for (empty: off): the one given, else the dataset's defaults."""
    if off:
        return ()
    if target_acc is None:
        return tuple(DEFAULT_TARGETS.get(data, ()))
    if not 0.0 <= target_acc <= 1.0:
        raise ValueError(f"--target-acc must be a validation accuracy between 0 and 1 (e.g. 0.9 for 90%), "
                         f"got {target_acc:g}; 0 switches time to accuracy off")
    return (target_acc,) if target_acc else ()


def _met(run: TTARun, target: float, metric: str) -> bool:
    if metric == "val_loss":
        return run.val_loss <= target
    return run.val_acc is not None and run.val_acc >= target


def shortest_budget(passes, budgets=BUDGETS, *, start: int | None = None) -> int | None:
    """The shortest budget in `budgets` for which `passes(budget)` holds, searching from `start`; None: none.

    Assumes that once a budget passes, longer ones do too. Each budget is asked at most once.
    """
    budgets = sorted(budgets)
    lo, hi = -1, None   # lo: the longest known to fail; hi: the shortest known to pass
    i = budgets.index(start) if start in budgets else min(len(budgets) - 1, len(budgets) // 2)
    while True:
        if passes(budgets[i]):
            hi = i
        else:
            lo = i
        if hi is None:
            if lo >= len(budgets) - 1:
                return None
            i = lo + max(1, (len(budgets) - 1 - lo) // 2)  # climb: half of what is left, at least one
        elif hi - lo <= 1:
            return budgets[hi]
        else:
            i = (lo + hi) // 2


class _Search:
    """Runs (cached) of one config over seeds and budgets; a budget passes when every seed meets the target.

    `run_seeds(name, seeds, budget, target, metric)` trains the seeds in turn in one process and
    stops at the first that misses `target` (None: it trains them all); it returns their runs.
    """

    def __init__(self, name: str, seeds: list[int], run_seeds, bar=None):
        self.name, self.seeds, self.run_seeds, self.bar = name, seeds, run_seeds, bar
        self.runs: dict[tuple[int, int], TTARun] = {}
        self.missed: list[int] = []  # seeds that missed before go first: a failing budget fails sooner

    def _train(self, budget: int, seeds: list[int], target: float | None, metric: str | None) -> None:
        if self.bar is not None:
            self.bar(f"{self.name}: {budget} steps, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}")
        for r in self.run_seeds(self.name, seeds, budget, target, metric):
            self.runs[budget, r.seed] = r

    def run(self, budget: int, seed: int) -> TTARun:
        if (budget, seed) not in self.runs:
            self._train(budget, [seed], None, None)
        return self.runs[budget, seed]

    def every_seed(self, budget: int) -> list[TTARun]:
        """Every seed's run at `budget` (the missing ones trained in one process, none stopped early)."""
        todo = [s for s in self.seeds if (budget, s) not in self.runs]
        if todo:
            self._train(budget, todo, None, None)
        return [self.runs[budget, s] for s in self.seeds]

    def passes(self, budget: int, target: float, metric: str) -> bool:
        order = sorted(self.seeds, key=lambda s: s not in self.missed)
        done = [self.runs[budget, s] for s in order if (budget, s) in self.runs]
        todo = [s for s in order if (budget, s) not in self.runs]
        if todo and all(_met(r, target, metric) for r in done):
            self._train(budget, todo, target, metric)  # one process; it stops at the first seed that misses
        for s in order:
            if (budget, s) not in self.runs:
                return False  # a seed before it missed: never reached
            if not _met(self.runs[budget, s], target, metric):
                if s not in self.missed:
                    self.missed.append(s)
                return False
        return True


def _base_run(*, model, data, batch_size, train_size, val_size, lr, optimizer, seed, device, image_size) -> dict:
    """What every run of the search shares: the workload, its sizes (by the image size), the optimizer and peak LR
    (a text workload: AdamW at 3e-3; else SGD at DEFAULT_LR)."""
    text = data == "text"
    return {"model": model, "data": data, "batch_size": batch_size,
            "train_size": train_size if train_size is not None else 2048 if image_size < 64 else 4 * batch_size,
            "val_size": val_size if val_size is not None else 1024 if image_size < 64 else 2 * batch_size,
            "lr": lr if lr is not None else (3e-3 if text else DEFAULT_LR),
            "optimizer": optimizer or ("adamw" if text else "sgd"), "data_seed": seed, "device": str(device),
            "image_size": image_size}


def run_time_to_target(*, model: str = "resnet20", data: str = "digits", targets: tuple[float, ...] = (0.97, 0.90),
                       metric: str = "val_acc", seeds: int = 3, seed: int = 0, batch_size: int = 64,
                       lr: float | None = None, optimizer: str | None = None, configs: tuple[str, ...] = CONFIGS,
                       budgets: tuple[int, ...] = BUDGETS, start: int = START, device: str | None = None,
                       compile: bool = True, train_size: int | None = None, val_size: int | None = None,
                       image_size: int = 32, busy: bool | None = None, ablation: bool = False,
                       target_from: str | None = None, progress: bool = True) -> TTAResult:
    """The shortest budget to each target per config (see the module docstring).

    `metric` "val_acc" (reach >= target) or "val_loss" (reach <= target). `target_from` ("all", or
    "naive": the plain loop) with `metric="val_loss"` and no targets: the target is the worst final
    validation loss that config reaches over the seeds at budget `start` (its default budget).
    """
    _check(seeds, metric, targets, target_from, configs)
    dev = default_device(device or None)
    if busy is None:
        busy = machine_busy()[0] if dev.type == "cpu" else False
    by_name = {c.name: c for c in bench_configs(dev, compile=compile, hand=False, busy=busy)}
    proc_cfg = {name: by_name["naive" if name == "naive" else "all"] for name in CONFIGS}
    base = _base_run(model=model, data=data, batch_size=batch_size, train_size=train_size, val_size=val_size, lr=lr,
                     optimizer=optimizer, seed=seed, device=dev, image_size=image_size)
    lr, optimizer = base["lr"], base["optimizer"]
    seed_list = [seed + i for i in range(seeds)]
    with tempfile.TemporaryDirectory(prefix="torchspeed-warm-") as warm_root, \
            progress_bar(enabled=progress) as bar:
        runner = _Runner(base, proc_cfg, bar)
        if "auto_warm" in configs:  # an earlier run measured everything (no budget): its cache, off the clock
            runner.fill_warm_caches(seed_list, warm_root)
        searches = {name: _Search(name, seed_list, runner.run_seeds, runner.say) for name in configs}
        if not targets:  # the target is what `target_from` (all, or naive: the plain loop) reaches in its default budget
            ref = searches[target_from]
            finals = [ref.run(start, s) for s in seed_list]
            targets = (max(r.val_loss for r in finals),) if metric == "val_loss" else (min(r.val_acc for r in finals),)
        order = sorted(targets, reverse=metric == "val_acc")  # the hardest first: the others start from it
        found = _find_budgets(searches, order, metric, budgets, start)
        same_budget = _auto_at_naive_budget(searches, order, found, metric, runner.say)
        ablation_rows: list = []
        if ablation and "auto" in searches and found[order[0]].get("auto"):
            first = searches["auto"].runs[found[order[0]]["auto"], seed_list[0]]
            ablation_rows = _ablation(list(first.decisions.get("recipe_on", [])), seed_list, runner.run_seeds,
                                      budgets, order[0], metric, found[order[0]].get("auto"), batch_size, runner.say)
    entries = target_entries(f"{model} on {data}", targets, metric, searches, found, batch_size, runner, same_budget)
    runs = [r for s in searches.values() for r in s.runs.values()]
    meta = provenance() | {"model": model, "data": data, "batch_size": batch_size, "lr_peak": lr,
                           "optimizer": optimizer, "schedule": "onecycle", "budgets": list(budgets),
                           "image_size": image_size, "busy": busy, "metric": metric}
    return TTAResult(targets=entries, runs=runs, recipes={str(k): v for k, v in runner.recipes.items()},
                     seeds=seed_list, meta=meta, ablation=ablation_rows)


def _check(seeds: int, metric: str, targets, target_from, configs) -> None:
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if metric not in ("val_acc", "val_loss"):
        raise ValueError(f"metric must be 'val_acc' or 'val_loss', got {metric!r}")
    for t in targets:
        if metric == "val_acc" and not 0.0 < t <= 1.0:
            raise ValueError(f"target must be a validation accuracy in (0, 1], got {t}")
    if not targets and target_from not in configs:
        raise ValueError("give at least one target, or target_from: the config whose final loss is the target")
    bad = set(configs) - set(CONFIGS)
    if bad:
        raise ValueError(f"unknown time-to-accuracy config(s) {sorted(bad)}; choose from {', '.join(CONFIGS)}")


class _Runner:
    """Starts the worker processes: one per (config, seeds, budget), each config the way the throughput bench
    starts it (allocator, OpenMP settings); `auto_warm` reads the cache `fill_warm_caches` left."""

    def __init__(self, base: dict, proc_cfg: dict, bar):
        self.base, self.proc_cfg, self.bar = base, proc_cfg, bar
        self.task = bar.add_task("time to accuracy", total=None)
        self.recipes: dict[int, dict] = {}
        self.warm_dirs: dict[int, str] = {}

    def say(self, what: str) -> None:
        self.bar.update(self.task, description=f"time to accuracy: {what}")
        self.bar.advance(self.task)

    def fill_warm_caches(self, seeds: list[int], root: str) -> None:
        for s in seeds:
            self.say(f"auto_warm: measuring the recipe and the switches for the cache, seed {s}")
            self.warm_dirs[s] = os.path.join(root, str(s))
            self.recipes[s] = _process(self.proc_cfg["auto_warm"], self.base | {
                "mode": "warm", "seed": s, "config": "auto_warm", "cache_dir": self.warm_dirs[s]})

    def run_seeds(self, name: str, seeds: list[int], budget: int, target: float | None, metric: str | None,
                  parts: tuple | None = None) -> list[TTARun]:
        """`seeds` in turn in one process of `name`'s kind (auto's recipe; `parts`: an ablation variant)."""
        spec = self.base | {"mode": "train", "config": name, "seed": seeds[0], "seeds": seeds, "budget": budget,
                            "target": target, "metric": metric, "parts": list(parts) if parts is not None else None,
                            "cache_dirs": {str(s): self.warm_dirs[s] for s in seeds} if name == "auto_warm" else {}}
        return [TTARun(**r) for r in _process(self.proc_cfg[name], spec)["runs"]]


def _find_budgets(searches: dict, order: list[float], metric: str, budgets, start: int) -> dict:
    """Per target (the hardest first) and config: the shortest passing budget, each search starting from the
    budget a harder target needed (auto's first search from half of all's budget)."""
    found: dict[float, dict[str, int | None]] = {}
    for t in order:
        found[t] = {}
        for name, srch in searches.items():
            hint = next((found[p][name] for p in reversed(list(found)) if found[p].get(name)), None)
            if hint is None and name == "auto" and "all" in found[t] and found[t]["all"]:
                hint = _nearest(budgets, found[t]["all"] // 2)
            found[t][name] = shortest_budget(lambda b, srch=srch, t=t: srch.passes(b, t, metric), budgets,
                                             start=hint or start)
    return found


def _auto_at_naive_budget(searches: dict, order: list[float], found: dict, metric: str, say) -> dict:
    """Final quality at equal length: auto trained for naive's budget, per target."""
    out: dict[float, dict] = {}
    if "naive" in searches and "auto" in searches:
        for t in order:
            b = found[t].get("naive")
            if b:
                say(f"auto at naive's budget of {b} steps")
                out[t] = _same_budget(b, searches["naive"].every_seed(b), searches["auto"].every_seed(b), metric)
    return out


def _same_budget(budget: int, naive: list[TTARun], auto: list[TTARun], metric: str) -> dict:
    """naive and auto trained for the same number of steps (naive's budget to the target), per seed."""
    key = "val_loss" if metric == "val_loss" else "val_acc"
    a, n = [getattr(r, key) for r in auto], [getattr(r, key) for r in naive]
    better = (lambda x, y: x <= y) if metric == "val_loss" else (lambda x, y: x >= y)
    return {"budget_steps": budget, "metric": key, "auto": a, "naive": n,
            "auto_mean": statistics.fmean(a), "naive_mean": statistics.fmean(n),
            "seeds_not_worse": sum(1 for x, y in zip(a, n) if better(x, y)),
            "not_worse": better(statistics.fmean(a), statistics.fmean(n))}


def _nearest(budgets, b: int) -> int:
    return min(budgets, key=lambda x: abs(x - b))


def _ablation(on: list[str], seeds: list[int], run_seeds, budgets, target: float, metric: str, auto_budget: int | None,
              batch: int, say) -> list:
    """Leave one part out (`on`: the parts auto turned on) or add one (parts it left off): the budget each needs."""
    rows = []
    for part in PARTS:
        if part in ("muon", "schedulefree", "batch"):  # optimizer parts: their own rows; batch: 300+ step runs only
            continue
        kind = "without" if part in on else "with"
        parts = tuple(p for p in on if p != part) if kind == "without" else (*on, part)
        srch = _Search(f"auto {kind} {part}", seeds,
                       lambda _, ss, b, t, m, parts=parts: run_seeds("auto", ss, b, t, m, parts), say)
        b = shortest_budget(lambda x: srch.passes(x, target, metric), budgets, start=auto_budget or START)
        row = {"variant": f"{kind} {part}", "part": part, "budget_steps": b,
               "samples_to_target": b * batch if b else None,
               "steps_vs_auto": (b / auto_budget) if b and auto_budget else None,
               "val_acc": {str(k): v.val_acc for k, v in srch.runs.items()}}
        if b and auto_budget:
            row["train_time_s"] = statistics.fmean(srch.runs[b, s].train_s for s in seeds)
        rows.append(row)
    return rows


def attach_time_to_target(result, tta: TTAResult) -> None:
    """Put the first target's numbers on the naive and all rows of a BenchResult and add the `tta` section."""
    first = tta.targets[0] if tta.targets else None
    for row in result.rows:
        c = first["configs"].get(row.config) if first else None
        if c is None:
            continue
        row.time_to_target_s = c["train_time_s"]
        row.steps_to_target = c["budget_steps"]
        row.val_acc_runs = c["val_acc"]
    result.tta = tta.to_dict()


# ---------------------------------------------------------------------- one run, in its own process
def _process(cfg, spec: dict) -> dict:
    spec = spec | {"train": asdict(replace(cfg.train, schedule="onecycle")), "num_workers": cfg.num_workers}
    proc = subprocess.run([sys.executable, "-m", "torchspeed.bench.time_to_target_worker"],
                          input=json.dumps(spec) + "\n", capture_output=True, text=True, env=config_env(cfg))
    what = f"time to accuracy, config {spec['config']!r} seed {spec['seed']}" + (
        f" budget {spec['budget']}" if "budget" in spec else "")
    for line in proc.stdout.splitlines():
        answer = read_reply(line, what)
        if answer is not None:
            return answer
    tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
    raise RuntimeError(f"{what}: its process exited (code {proc.returncode})\n{tail}")
