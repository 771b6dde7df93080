"""The suite's runner: every registered workload, each row timed to its target through `fit`, scored as AlgoPerf does.

What `torchspeed bench` runs by default (docs/bench.md). For each workload of `bench/suite.py` and each seed, the
rows (`ROWS`), one after the other in one process, every `fit` row from an empty decision cache:

- `naive`: the plain loop (`suite.plain_run`): the workload's optimizer at its constant LR;
- `fit`: `torchspeed.fit` with the plain loop's optimizer object (so its LR, constant: the schedule rule) on a
  `DataLoader` over a `TensorDataset` of the same tensors, every speed switch at its default (T10, T11, T13,
  T18, T21, T23, T25, T26: the measured switch trial);
- `all`: the same with a one-cycle schedule (T14) peaking at the plain loop's LR;
- `schedulefree`: Schedule-Free AdamW (`train/optim.py`) at its own defaults, no schedule;
- `onecycle`: the fixed recipe a user would pick: AdamW (SGD for an SGD workload) by name, one-cycle at the
  plain loop's LR;
- `auto`: `fit(recipe="auto")` with no LR, cold: the measured recipe (T15 + T32 + T33), choosing on the clock;
- `auto_warm`: the same, reading the cache its seed's cold `auto` run left.

A row's time to target is the seconds from the start of its call (choosing, the switch trial and evaluations
counted; building the model and the loaders not) to its first evaluation at the target (one per epoch). Its
budget: rows at a constant LR (or none) train up to `BUDGET_FACTOR` times the plain loop's epochs; a scheduled
row's schedule spans the plain loop's epochs, as a user who keeps their epochs and adds a schedule runs it.
`auto` is given the same budget as the unscheduled rows, as AlgoPerf gives a self-tuning method the
workload's whole budget: the recipe plans its schedule (or none) for the length it is given.
A run also stops once it is `TIME_CAP` times past the plain loop's whole budget (AlgoPerf's runtime budget,
at least `MIN_CAP_S`); a run that stops before the target is a miss. The seeds are rounds: in each, every
workload runs each of its rows in turn, the rows rotated from seed to seed (`train/rounds.round_order`), so
the machine's drifts hit every row alike. A run at its target before `REPEAT_UNDER_S` is run `REPEATS` times (cold
rows cold each time), its median kept (`suite.median_run`). Per workload and row the median over the seeds (a miss
infinite) goes into the AlgoPerf table (`suite.relative_times`, ...).

Example:
    >>> res = run_suite(seeds=(0,), workloads=["mlp"])
    >>> res["table"]["mlp"]["auto"], res["score"]["geomean_vs_naive"]["auto"]
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.bench.runner import provenance
from torchspeed.bench.suite import (EVAL_BATCH, SuiteData, Workload, geometric_mean_speed, load_data, make_optimizer,
                                    median_run, performance_profile, plain_run, profile_score, reached,
                                    relative_times, suite_workloads, targets_reached)
from torchspeed.fitting import fit
from torchspeed.train.losses import default_loss
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.optim import SCHEDULE_FREE_LR, schedule_free_available
from torchspeed.train.rounds import round_order

__all__ = ["ROWS", "SCHEDULED", "BUDGET_FACTOR", "TIME_CAP", "MIN_CAP_S", "DEFAULT_SEEDS", "TIME_LIMIT_S", "STOP_MARGIN_S",
           "StopAtTarget", "fit_kwargs", "run_row", "run_suite", "reduce_seeds", "score"]

ROWS = ("naive", "fit", "all", "schedulefree", "onecycle", "auto", "auto_warm")
SCHEDULED = ("all", "onecycle")  # one-cycle over the plain loop's epochs (auto plans for the budget it is given)
BUDGET_FACTOR = 2        # rows at a constant LR (or none) train up to this many times the plain loop's epochs
TIME_CAP = 4.0           # ... and stop once past this many times the plain loop's seconds for its whole budget
MIN_CAP_S = 5.0          # ... but never before this many seconds (fit's fixed costs on the smallest workloads)
DEFAULT_SEEDS = (0, 1, 2)
TIME_LIMIT_S = 480.0     # run_suite starts no seed whose estimated time would end past this, no workload past it
STOP_MARGIN_S = 90.0     # ... and stops a workload still running this long after it (its seed's runs dropped)
REPEAT_UNDER_S, REPEATS = 0.5, 3  # a run at its target this soon is run REPEATS times, the median kept (noise: ~30 ms)


class StopAtTarget(Callback):
    """Stops a `fit` run at its first evaluation at the workload's target and remembers when (seconds from `t0`)
    and at which step; also stops it at the first step end past `cap_s` seconds (a miss).

    A loss target is judged on the plain loss: where the run trains with label smoothing, that evaluation
    is repeated with the plain cross-entropy, and its seconds (`judge_s`) are the bench's, not the row's."""

    def __init__(self, workload: Workload, val_loader, t0: float, cap_s: float | None = None):
        self.workload, self.val_loader, self.t0, self.cap_s = workload, val_loader, t0, cap_s
        self.at: float | None = None
        self.step: int | None = None
        self.metric: float | None = None
        self.stopped, self.judge_s = "budget", 0.0

    def on_evaluate(self, trainer, metrics: dict) -> None:
        value = metrics.get(self.workload.metric)
        if value is None or self.at is not None or self.stopped == "time cap":  # past the cap: a miss
            return
        if self.workload.metric == "val_loss" and getattr(trainer.config, "label_smoothing", 0.0):
            t = time.perf_counter()
            value = _plain_loss(trainer, self.val_loader)
            self.judge_s += time.perf_counter() - t
        self.metric = float(value)
        if reached(self.workload, self.metric):
            self.at, self.step = time.perf_counter() - self.t0 - self.judge_s, trainer.step
            self.stopped = "target"
            trainer.request_stop(f"{self.workload.metric} {self.metric:.4g} at the target {self.workload.target}")

    def on_step_end(self, trainer) -> None:
        if self.cap_s is not None and self.at is None and not trainer.should_stop \
                and time.perf_counter() - self.t0 - self.judge_s > self.cap_s:
            self.stopped = "time cap"
            trainer.request_stop(f"past the time cap of {self.cap_s:.1f} s")


def _plain_loss(trainer, val_loader) -> float:
    """The validation loss under the plain cross-entropy (the run's own loss smooths its labels)."""
    own, trainer.loss_fn = trainer.loss_fn, default_loss()
    try:
        return float(trainer.evaluate(val_loader)["val_loss"])
    finally:
        trainer.loss_fn = own


class _QuietStops(logging.Filter):
    """Drops the trainer's "stopping: ..." line: the suite's progress line and its JSON say why each run stopped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("stopping:")


@contextmanager
def _cache_dir(path: str):
    """`TORCHSPEED_CACHE_DIR` set to `path` inside the block (fit's decision cache), as it was after."""
    before = os.environ.get("TORCHSPEED_CACHE_DIR")
    os.environ["TORCHSPEED_CACHE_DIR"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCHSPEED_CACHE_DIR", None)
        else:
            os.environ["TORCHSPEED_CACHE_DIR"] = before


def budget_epochs(workload: Workload, row: str) -> int:
    """The epochs a row may train: the plain loop's for a scheduled row, `BUDGET_FACTOR` times them otherwise."""
    return workload.epochs if row in SCHEDULED else BUDGET_FACTOR * workload.epochs


def fit_kwargs(workload: Workload, row: str, model: nn.Module) -> dict:
    """The arguments (beyond model, data, epochs, callbacks) with which the `fit` row `row` calls `fit`."""
    named = "sgd" if workload.optimizer == "sgd" else "adamw"  # the optimizer a user names for this loop
    kw: dict = {"loss_fn": nn.MSELoss() if workload.loss == "mse" else None, "progress": False}
    if row == "fit":
        return kw | {"optimizer": make_optimizer(workload, model)}
    if row == "all":
        return kw | {"optimizer": make_optimizer(workload, model), "schedule": "onecycle"}
    if row == "schedulefree":
        return kw | {"optimizer": "schedulefree", "lr": SCHEDULE_FREE_LR}
    if row == "onecycle":
        return kw | {"optimizer": named, "lr": workload.lr, "schedule": "onecycle"}
    if row in ("auto", "auto_warm"):
        return kw | {"optimizer": named, "recipe": "auto"}
    raise ValueError(f"no fit row {row!r}; rows: {', '.join(ROWS)}")


def _loaders(workload: Workload, data: SuiteData, seed: int) -> tuple[DataLoader, DataLoader]:
    """The training loader (shuffled by `seed`: the plain loop's batches) and the held-out one."""
    g = torch.Generator().manual_seed(seed)
    return (DataLoader(TensorDataset(data.x, data.y), batch_size=workload.batch_size, shuffle=True, generator=g),
            DataLoader(TensorDataset(data.vx, data.vy), batch_size=EVAL_BATCH))


def run_row(workload: Workload, row: str, seed: int, data: SuiteData, *, cap_s: float | None = None,
            cache_dir: str | None = None) -> dict:
    """One run of `row` on `workload` for `seed`, stopped at its target, its budget or its time cap.

    `fit` rows read and write their decision cache in `cache_dir` (default: a new empty folder). Returns the
    budget, seconds to target (None: missed), the whole call's seconds, steps to target and trained, the
    seconds and steps spent choosing (off the run, and in it), why it stopped, and what fit decided."""
    epochs = budget_epochs(workload, row)
    steps_per_epoch = math.ceil(len(data.x) / workload.batch_size)
    out = {"seed": seed, "budget_epochs": epochs, "budget_steps": epochs * steps_per_epoch}
    if row == "naive":
        return out | _naive(workload, seed, data, epochs, cap_s)
    with tempfile.TemporaryDirectory(prefix="torchspeed-suite-") as cold, _cache_dir(cache_dir or cold):
        torch.manual_seed(seed)
        model = workload.model()
        train, val = _loaders(workload, data, seed)
        kw = fit_kwargs(workload, row, model)
        t0 = time.perf_counter()
        stop = StopAtTarget(workload, val, t0, cap_s)
        quiet = _QuietStops()
        logging.getLogger("torchspeed").addFilter(quiet)
        try:
            result = fit(model, train, epochs=epochs, val_loader=val, callbacks=[stop], **kw)
        finally:
            logging.getLogger("torchspeed").removeFilter(quiet)
        seconds = time.perf_counter() - t0 - stop.judge_s
    tuning = result.decisions.get("tuning")
    measured = dict(getattr(tuning, "measured", None) or {})
    keep = ("optimizer", "lr", "precision", "channels_last", "schedule", "label_smoothing", "ema", "bn_stats",
            "compile", "recipe_prior")
    call = {k: v if isinstance(v, (str, int, float)) else type(v).__name__ for k, v in kw.items() if v is not None}
    return out | {"call": call, "to_target_s": stop.at, "reached": stop.at is not None, "seconds": seconds,
                  "steps_to_target": stop.step, "steps_trained": result.steps, "stopped": stop.stopped,
                  "metric": stop.metric, "choosing_s": float(measured.get("seconds", 0.0)),
                  "in_run_choosing_s": float(measured.get("in_run_s", 0.0)),
                  "steps_measured": int(measured.get("steps_off_run", 0)) + int(measured.get("in_run_steps", 0)),
                  "decisions": {k: str(result.decisions[k])[:120] for k in keep if k in result.decisions}}


def _naive(workload: Workload, seed: int, data: SuiteData, epochs: int, cap_s: float | None) -> dict:
    """The plain loop to its target (`suite.plain_run`), stopped past `cap_s` too."""
    at: list = []
    state = {"stopped": "budget", "metric": None}

    def on_epoch(epoch: int, metric: float) -> bool:
        state["metric"] = metric
        if reached(workload, metric):
            at.append(time.perf_counter() - t0)
            state["stopped"] = "target"
            return True
        if cap_s is not None and time.perf_counter() - t0 > cap_s:
            state["stopped"] = "time cap"
            return True
        return False

    t0 = time.perf_counter()
    out = plain_run(workload, seed, epochs=epochs, on_epoch=on_epoch, data=data)
    seconds = time.perf_counter() - t0
    return {"call": {"loop": "plain_run", "optimizer": workload.optimizer, "lr": workload.lr},
            "to_target_s": at[0] if at else None, "reached": bool(at), "seconds": seconds,
            "steps_to_target": out["steps"] if at else None, "steps_trained": out["steps"],
            "stopped": state["stopped"], "metric": state["metric"], "choosing_s": 0.0, "in_run_choosing_s": 0.0,
            "steps_measured": 0, "decisions": {}}


def _warm_up(workload: Workload, data: SuiteData, first: bool) -> float:
    """Untimed first-call set-up: two plain epochs (the second's seconds, past the first calls, set the time cap),
    and for the suite's first workload one short cold `fit(recipe="auto")` (fit's and the recipe's own imports).
    Returns the second epoch's seconds, its evaluation included."""
    ends = [time.perf_counter()]
    plain_run(workload, 0, epochs=2, data=data, on_epoch=lambda epoch, metric: bool(ends.append(time.perf_counter())))
    epoch_s = ends[-1] - ends[-2]
    if first:
        n = 2 * workload.batch_size
        small = SuiteData(data.x[:n], data.y[:n], data.vx[:n], data.vy[:n])
        torch.manual_seed(0)
        model = workload.model()
        train, val = _loaders(workload, small, 0)
        with tempfile.TemporaryDirectory(prefix="torchspeed-suite-") as cold, _cache_dir(cold):
            fit(model, train, epochs=1, val_loader=val, **fit_kwargs(workload, "auto", model))
    return epoch_s


def _units(rows: Sequence[str]) -> list[tuple[str, ...]]:
    """The rows as turns: auto_warm runs right after its seed's auto (it reads the cache auto left)."""
    if "auto_warm" in rows and "auto" not in rows:
        raise ValueError("the auto_warm row reads the cache its seed's cold auto run leaves: add auto to the rows")
    return [("auto", "auto_warm") if r == "auto" and "auto_warm" in rows else (r,) for r in rows if r != "auto_warm"]


def _check_rows(rows: Sequence[str]) -> tuple[list[str], list[str]]:
    """The rows to run in `ROWS` order, and those left out (schedulefree without its package)."""
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        raise ValueError(f"rows {', '.join(map(repr, unknown)) or '(none)'}: choose from {', '.join(ROWS)}")
    left = [r for r in rows if r == "schedulefree" and not schedule_free_available()]
    return [r for r in ROWS if r in rows and r not in left], left


def run_suite(*, workloads: Sequence[str] | None = None, rows: Sequence[str] = ROWS,
              seeds: Sequence[int] = DEFAULT_SEEDS, time_limit_s: float | None = TIME_LIMIT_S,
              console: Console | None = None, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Every workload (`workloads`: names, default all registered) x row x seed, interleaved; the JSON-ready result.

    `time_limit_s` (None: none): a seed after the first starts only where the time so far plus the last seed's
    fits in it, no workload starts past it, and one still running `STOP_MARGIN_S` after it is stopped and its
    runs of that seed dropped (a workload's rows run together or not at all); what was left out is listed, and a
    workload with no run is left out of the table. `console` gets one progress line per run."""
    console = console or Console()
    chosen = suite_workloads(workloads)
    rows, rows_left_out = _check_rows(rows)
    _units(rows)  # auto_warm without auto: refused before anything runs
    start = clock()
    data = {w.name: load_data(w) for w in chosen}
    caps = {}
    for i, w in enumerate(chosen):
        epoch_s = _warm_up(w, data[w.name], first=i == 0)
        caps[w.name] = max(MIN_CAP_S, TIME_CAP * epoch_s * w.epochs)
    runs: dict[str, dict[str, list]] = {w.name: {r: [] for r in rows} for w in chosen}
    done, left_out, per_seed = [], [], []
    for k, seed in enumerate(seeds):
        elapsed = clock() - start
        if k and time_limit_s is not None and elapsed + max(per_seed) > time_limit_s:
            left_out += [{"seed": s, "workloads": [w.name for w in chosen]} for s in seeds[k:]]
            console.print(f"[yellow]suite: seeds {', '.join(map(str, seeds[k:]))} left out: another seed would end "
                          f"past the {time_limit_s:.0f} s limit ({elapsed:.0f} s so far)[/]")
            break
        seed_t0 = clock()
        late = _one_seed(chosen, rows, k, seed, runs, data, caps, console=console, clock=clock, start=start,
                         limit=time_limit_s, n_seeds=len(seeds))
        per_seed.append(clock() - seed_t0)
        done.append(seed)
        if late:
            left_out += [{"seed": seed, "workloads": late}] + [{"seed": s, "workloads": [w.name for w in chosen]}
                                                              for s in seeds[k + 1:]]
            console.print(f"[yellow]suite: past the {time_limit_s:.0f} s limit: seed {seed} left out "
                          f"{', '.join(late)}{', and every later seed' if seeds[k + 1:] else ''}[/]")
            break
    ran = [w for w in chosen if any(runs[w.name].values())]
    table = reduce_seeds({w.name: runs[w.name] for w in ran})
    return {"kind": "suite", "rows": rows, "rows_left_out": rows_left_out, "seeds": done, "left_out": left_out,
            "settings": {"budget_factor": BUDGET_FACTOR, "scheduled_rows": list(SCHEDULED), "time_cap": TIME_CAP,
                         "min_cap_s": MIN_CAP_S, "time_limit_s": time_limit_s},
            "workloads": {w.name: _workload_entry(w, data[w.name], caps[w.name], runs[w.name], table[w.name])
                          for w in ran},
            "table": table, "score": score(table), "seconds": clock() - start, "load_average": os.getloadavg(),
            "provenance": provenance()}


def _one_seed(chosen: Sequence[Workload], rows: Sequence[str], k: int, seed: int, runs: dict, data: dict,
              caps: dict, *, console: Console, clock: Callable[[], float], start: float, limit: float | None,
              n_seeds: int) -> list[str]:
    """Seed `seed` (the `k`-th round): each workload's rows in turn, rotated by `k`; `runs` gets each run. Returns
    the workloads left out: those whose turn came past `limit`, and one still running at `limit + STOP_MARGIN_S`
    (its runs stop there, and its runs of this seed are dropped: a workload's rows run together or not at all)."""
    order = round_order(_units(rows), k + 1, "rotate")  # the rows rotated from seed to seed
    total = len(chosen) * len(rows) * n_seeds
    hard = None if limit is None else limit + STOP_MARGIN_S
    for i, w in enumerate(chosen):
        if limit is not None and clock() - start > limit:
            return [x.name for x in chosen[i:]]
        for unit in order:
            with tempfile.TemporaryDirectory(prefix="torchspeed-suite-auto-") as shared:
                for row in unit:  # auto_warm reads what its seed's auto left in `shared`
                    n_done = sum(len(v) for per in runs.values() for v in per.values())
                    console.print(f"[dim]suite {n_done + 1}/{total}[/] {w.name} · {row} · seed {seed} · "
                                  f"{_eta(runs, chosen, rows, n_seeds, clock() - start)}")
                    cap = caps[w.name] if hard is None else min(caps[w.name], hard - (clock() - start))
                    run = lambda d: run_row(w, row, seed, data[w.name], cap_s=cap, cache_dir=d)  # noqa: E731
                    first = run(shared if len(unit) > 1 else None)
                    again = [run(shared if row == "auto_warm" else None) for _ in range(REPEATS - 1)] if (
                        first["reached"] and first["to_target_s"] < REPEAT_UNDER_S) else []  # cold rows cold again
                    runs[w.name][row].append(median_run([first, *again]))
                    if hard is not None and clock() - start > hard:
                        for v in runs[w.name].values():
                            v[:] = [r for r in v if r["seed"] != seed]
                        return [x.name for x in chosen[i:]]
    return []


def _eta(runs: dict, chosen: Sequence[Workload], rows: Sequence[str], n_seeds: int, elapsed: float) -> str:
    """"about M:SS left": each run still to come priced at its own earlier seeds' mean, else the mean run so far."""
    cost = lambda r: r.get("all_repeats_s", r["seconds"])  # noqa: E731  (a short run's repeats included)
    secs = [cost(r) for per in runs.values() for v in per.values() for r in v]
    if not secs:
        return "time left: measuring the first run"
    left = sum((statistics.fmean(map(cost, runs[w.name][r])) if runs[w.name][r] else elapsed / len(secs))
               * (n_seeds - len(runs[w.name][r])) for w in chosen for r in rows)
    return f"about {int(left // 60)}:{int(left % 60):02d} left"


def _workload_entry(w: Workload, data: SuiteData, cap_s: float, runs: dict, table_row: dict) -> dict:
    return {"kind": w.kind, "description": w.description, "metric": w.metric, "target": w.target,
            "plain_loop": {"optimizer": w.optimizer, "lr": w.lr, "batch_size": w.batch_size, "epochs": w.epochs},
            "train_samples": len(data.x), "val_samples": len(data.vx), "time_cap_s": cap_s,
            "rows": {r: {"to_target_s": table_row[r], "reached": sum(x["reached"] for x in v), "seeds": len(v),
                         "budget_epochs": v[0]["budget_epochs"] if v else None,
                         "budget_steps": v[0]["budget_steps"] if v else None, "runs": v}
                     for r, v in runs.items()}}


def reduce_seeds(runs: dict[str, dict[str, list]]) -> dict[str, dict[str, float | None]]:
    """The AlgoPerf table: per workload and row the median of its seeds' seconds to target, a missed seed
    infinite (so a row that missed on half its seeds or more misses); None where that median is infinite."""
    out = {}
    for name, per in runs.items():
        out[name] = {}
        for row, v in per.items():
            med = statistics.median([math.inf if r["to_target_s"] is None else r["to_target_s"] for r in v]) \
                if v else math.inf
            out[name][row] = med if math.isfinite(med) else None
    return out


def score(table: dict) -> dict:
    """AlgoPerf's numbers on the table: relative times, the geometric-mean speed against naive, targets
    reached, the performance profile and its score."""
    rows = list(dict.fromkeys(r for per in table.values() for r in per))
    profile = performance_profile(table)
    return {"relative": {w: {r: (v if math.isfinite(v) else None) for r, v in per.items()}
                         for w, per in relative_times(table).items()},
            "geomean_vs_naive": {r: geometric_mean_speed(table, r, "naive") for r in rows} if "naive" in rows else {},
            "targets_reached": targets_reached(table), "profile": profile, "profile_score": profile_score(profile)}
