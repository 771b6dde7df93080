"""A training recipe chosen by measuring the user's own model and training data: fewer steps to the same accuracy.

The speed switches (precision, channels_last, fused kernels, compile) make each step cheaper;
the recipe makes fewer steps do. `fit(..., recipe="auto")` calls `choose_recipe` before
training; every part is also a plain function or object for your own loop. Each choice goes
into `decisions` with its reason. Nothing here reads a validation set: the choices are made on
training batches alone (a test replaces the validation set and checks they do not change).

The parts (`PARTS`), and how each is chosen:

- `lr` (T14, T15): the one-cycle peak LR and floor from the LR range test (`find_lr`), run
  with the optimizer and precision the run trains with. When its curve is flat or noisy the
  range test says so and falls back to a short measured trial of a few LRs.
- `label_smoothing` (T32): 0.1 for per-sample classification with the default cross-entropy
  (a model that returns its own loss, your own `loss_fn`, and per-token outputs such as a
  language model's are left alone).
- `bn_stats` (T47): BatchNorm statistics averaged over the last tenth of the run
  (`train.bnstats.FinalBatchNormStats`), so evaluation uses statistics of the final weights.
  The largest single saving measured on the digits (docs/recipe.md). Costs nothing.
- `ema` (T40): an EMA of the weights (`train.callbacks.EMA`, on `torch.optim.swa_utils`) for
  runs long enough for the average to span a small part of them (>= `EMA_MIN_STEPS` steps;
  decay so that it spans about a twentieth of the run). Shorter runs: off; on the digits at
  48 steps it gained nothing (docs/recipe.md).
- `tta` (T33): flip test-time augmentation, decided *after* training by `choose_tta` on a
  few training batches: kept only when it scores better there (the digits are not
  flip-invariant: it is refused there).
- `muon` (T42): for an AdamW run of a model whose weights are mostly hidden 2D matrices
  (transformers, MLPs), `torch.optim.Muon` for those matrices when a short trial says it
  learns faster (`tune.optimizer_trial`).
- `batch` (T17): for runs of at least `BATCH_MIN_STEPS` steps, the batch with the least
  predicted time to a target: samples needed grow as 1 + B/B_noise (the gradient noise scale,
  measured at the end of the LR trial), divided by the samples/s measured at half to four
  times the loader's batch (`tune.batch_choice`). The LR follows (linear rule for SGD, square
  root for Adam-family). `fit` rebuilds the DataLoader; a batch size given to `fit` switches
  the part off.

Cost: the range test's steps (100 by default) and, when asked, the fallback and optimizer
trials; `Recipe.tuning_s` and `Recipe.tuning_steps` report it, and the bench counts it
("tuning included").

Example:
    >>> recipe = choose_recipe(model, loader, optimizer="sgd", total_steps=500)
    >>> fit(model, loader, lr=recipe.lr, min_lr=recipe.min_lr, label_smoothing=recipe.label_smoothing,
    ...     callbacks=recipe.callbacks())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from torchspeed.plan.budget import TuningBudget
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.tune.batch_choice import BATCH_MIN_STEPS

__all__ = ["PARTS", "EMA_MIN_STEPS", "Recipe", "choose_recipe", "choose_tta", "decide_tta", "is_classifier",
           "refine_onecycle_peak"]

PARTS = ("lr", "label_smoothing", "bn_stats", "ema", "tta", "muon", "schedulefree", "batch")
LABEL_SMOOTHING = 0.1
EMA_MIN_STEPS = 2000
PROBE_BATCHES = 4
LR_TRIAL_FACTORS = (1.0, 2.0, 4.0)  # the one-cycle peaks the LR trial compares: the range test's pick, and above it
LR_TRIAL_MARGIN = 0.02              # a higher peak must lower the trial's final loss by more than this
NOISE_BATCHES = 8                   # batches of the LR trial's own on which the batch part's noise scale is measured


@dataclass
class Recipe:
    """What `choose_recipe` picked; `config()` and `callbacks()` hand it to `fit`/`Trainer`."""

    lr: float | None = None              # one-cycle peak LR (None: the caller's own)
    min_lr: float | None = None          # the schedule's floor (None: the schedule's default)
    label_smoothing: float = 0.0
    bn_stats: bool = False
    ema_decay: float | None = None
    optimizer: str | None = None         # "muon" when the trial picked it (None: the caller's)
    batch_size: int | None = None        # the batch part's choice (None: the loader's own)
    tta: str | None = None               # decided after training (choose_tta)
    parts: tuple[str, ...] = PARTS
    tuning_s: float = 0.0                # seconds spent choosing
    tuning_steps: int = 0                # training steps (forward + backward) spent choosing
    decisions: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)  # parts measured later, in the run's first steps (plan/inrun.py)
    probe: list = field(default_factory=list, repr=False)  # training batches for choose_tta

    def config(self) -> dict:
        """The `TrainConfig` fields this recipe sets."""
        out: dict = {"label_smoothing": self.label_smoothing}
        if self.min_lr is not None:
            out["min_lr"] = self.min_lr
        return out

    def callbacks(self) -> list:
        """The callbacks this recipe adds: BatchNorm statistics over the last steps, an EMA."""
        from torchspeed.train.bnstats import FinalBatchNormStats
        from torchspeed.train.callbacks import EMA

        cbs: list = []
        if self.bn_stats:
            cbs.append(FinalBatchNormStats())
        if self.ema_decay is not None:
            cbs.append(EMA(self.ema_decay))
        return cbs

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("probe")
        d["decisions"] = {k: str(v) for k, v in self.decisions.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "probe"}
        if "parts" in known:
            known["parts"] = tuple(known["parts"])
        return cls(**known)


def is_classifier(model: nn.Module, batch, *, loss_fn: Callable | None = None,
                  step_fn: Callable | None = None) -> bool:
    """Whether `model` on `batch` is per-sample classification on the default cross-entropy: logits (B, C), C > 2."""
    from torchspeed.train.batch import forward_loss

    if loss_fn is not None or step_fn is not None:
        return False
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = forward_loss(model, batch)
    except Exception:  # a batch this check cannot read: leave classification parts off
        return False
    finally:
        model.train(was)
    if getattr(out, "own_loss", False) or out.logits is None or out.target is None:
        return False  # the model computes its own loss: not ours to smooth
    if out.logits.dim() != 2:
        return False  # per-token (language models) or per-pixel outputs: smoothing is not part of their recipe
    return out.correct() is not None and out.logits.shape[-1] > 2


def choose_recipe(model: nn.Module, train_loader: Iterable, *, optimizer: str | torch.optim.Optimizer = "sgd",
                  lr: float = 0.1, weight_decay: float | None = None, optimizer_options: dict | None = None,
                  precision: str = "auto", loss_fn: Callable | None = None, step_fn: Callable | None = None,
                  total_steps: int | None = None, schedule: str | None = "onecycle",
                  parts: Sequence[str] = PARTS, device: torch.device | str | None = None,
                  lr_steps: int = 100, lr_trial_steps: int = 24, progress: bool = True,
                  budget: TuningBudget | None = None, cache: TrialCache | None = None,
                  lr_in_run: bool = False) -> Recipe:
    """Choose each recipe part in `parts` from `model` and the training batches; leaves the model, its optimizer
    state, every RNG and the loader's data order as they were.

    `lr` is the peak LR used when the `lr` part is off or not measured; `total_steps` (optimizer
    steps of the coming run) decides the EMA. `budget` (`plan.budget.TuningBudget`; None: no
    limit) bounds the parts that train off the run: a part it cannot afford is read from `cache`
    (an earlier run's measurement of this model, input and machine) or left at its prior, and
    its Decision says which. Measured parts are written to `cache` for the next run. With
    `lr_in_run` an affordable LR part is not measured here but left in `Recipe.pending`, for the
    run to measure right after its switch trial, at the precision that trial chose (`plan.inrun`).
    """
    from torchspeed.env import default_device
    from torchspeed.train.sampler import keep_rng, take_batches
    from torchspeed.train.transfer import to_device

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown recipe part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else default_device(None)
    model.to(dev)
    held = take_batches(train_loader, PROBE_BATCHES)
    rec = Recipe(lr=lr, parts=tuple(parts), probe=held)
    classifier = is_classifier(model, to_device(held[0], dev), loss_fn=loss_fn, step_fn=step_fn)
    _free_parts(rec, model, classifier, total_steps)
    opt_name = optimizer if isinstance(optimizer, str) else None
    lr_loss = loss_fn  # the tuners train on the loss the run trains on
    if lr_loss is None and rec.label_smoothing:
        from torchspeed.train.batch import default_loss

        lr_loss = default_loss(rec.label_smoothing)
    gate = _Gate(rec, budget, cache, _cache_key(model, held[0], opt_name or type(optimizer).__name__, lr, schedule,
                                                precision, parts))
    tuners = dict(weight_decay=weight_decay, optimizer_options=optimizer_options, precision=precision,
                  step_fn=step_fn, progress=progress)
    with keep_rng(train_loader):  # the tuners read the loader: the run's data order stays as it was
        if opt_name is not None and {"muon", "schedulefree"} & set(parts):
            _choose_optimizer(model, train_loader, rec, gate, given=opt_name, lr=lr, schedule=schedule,
                              precision=precision, loss_fn=loss_fn, step_fn=step_fn, total_steps=total_steps)
        schedule_free = rec.optimizer == "schedulefree"
        batch_wanted = "batch" in parts and total_steps is not None and total_steps >= BATCH_MIN_STEPS
        measured: dict = {}
        if "lr" in parts and not schedule_free:
            lr_cost = lr_steps + (len(LR_TRIAL_FACTORS) * lr_trial_steps if schedule == "onecycle" else 0)
            if lr_in_run and gate.measure("lr", lr_cost):
                rec.pending["lr"] = {"cost": lr_cost, "key": gate.key, "lr_steps": lr_steps,
                                     "lr_trial_steps": lr_trial_steps}
                rec.min_lr = lr / 10 if schedule == "onecycle" else None  # rescaled with the measured peak
                rec.decisions["lr"] = Decision(lr, f"prior {lr:g} for the first steps; measured in the run right "
                                                   "after the switch trial, at the precision it chooses "
                                                   f"(~{lr_cost} steps off the run, within the budget)")
            elif gate.measure("lr", lr_cost):
                measured = _choose_lr(model, train_loader, rec, optimizer=optimizer, name=rec.optimizer or opt_name,
                                      schedule=schedule, loss_fn=lr_loss, lr_steps=lr_steps,
                                      lr_trial_steps=lr_trial_steps, noise=batch_wanted, **tuners)
                gate.done("lr", {"lr": rec.lr, "min_lr": rec.min_lr})
            else:
                rec.lr = gate.settle("lr", "lr", lr, f"the given peak LR {lr:g}", default=lr)
                cached = gate.cached("lr")
                rec.min_lr = cached.get("min_lr") if cached else None
        if "batch" in parts:
            if not batch_wanted or gate.measure("batch_size", BATCH_COST):
                _choose_batch(model, train_loader, rec, optimizer=optimizer, name=rec.optimizer or opt_name,
                              loss_fn=lr_loss, total_steps=total_steps, noise_scale=measured.get("noise_scale"),
                              **tuners)
                if batch_wanted:
                    gate.done("batch_size", {"batch_size": rec.batch_size})
            else:
                rec.batch_size = gate.settle("batch_size", "batch_size", None, "the loader's batch", default=None)
    if "tta" in parts:
        rec.decisions["tta"] = Decision(None, "decided after training, on training batches (choose_tta)")
    gate.save()
    rec.tuning_s = time.perf_counter() - t0
    rec.decisions["recipe_cost"] = Decision(round(rec.tuning_s, 2), f"{rec.tuning_steps} training steps spent "
                                            "choosing off the run" + (f" (budget {budget.limit} steps, "
                                                                      f"{budget.share:.0%} of the run)" if budget else ""),
                                            measured={"seconds": rec.tuning_s, "steps": rec.tuning_steps})
    return rec


# Training steps off the run that each measured part costs (the budget's currency); the optimizer trial costs
# OPTIMIZER_TRIAL_STEPS per candidate
BATCH_COST = 60           # the batch timing at 1-4x the batch, and the noise batches


def _free_parts(rec: Recipe, model: nn.Module, classifier: bool, total_steps: int | None) -> None:
    """The parts that cost nothing to choose: label smoothing, BatchNorm statistics, the EMA."""
    from torchspeed.train.bnstats import batchnorm_layers

    d, parts = rec.decisions, rec.parts
    if "label_smoothing" in parts:
        if classifier:
            rec.label_smoothing = LABEL_SMOOTHING
            d["label_smoothing"] = Decision(LABEL_SMOOTHING, "classification with the default cross-entropy (T32)")
        else:
            d["label_smoothing"] = Decision(0.0, "not a classifier on the default cross-entropy: left alone")
    if "bn_stats" in parts:
        n_bn = len(batchnorm_layers(model))
        rec.bn_stats = n_bn > 0
        d["bn_stats"] = Decision(rec.bn_stats, f"{n_bn} BatchNorm layers: statistics averaged over the run's last "
                                               "tenth (T47)" if n_bn else "no BatchNorm layer")
    if "ema" in parts:
        _choose_ema(rec, total_steps)


def _cache_key(model, batch, optimizer: str, lr: float, schedule, precision, parts) -> str:
    from torchspeed.env import detect
    from torchspeed.train.switches import batch_signature, model_signature

    info = detect()
    return TrialCache.key({"recipe": 1, "model": model_signature(model), "batch": batch_signature(batch),
                           "optimizer": optimizer, "lr": lr, "schedule": schedule, "precision": precision,
                           "parts": sorted(parts), "cpu": info.cpu_model, "device": info.device_name,
                           "torch": torch.__version__})


class _Gate:
    """For each part that trains off the run: measure it (the budget allows), read an earlier run's measurement
    (the cache), or keep the prior; every way ends in a Decision that says which."""

    def __init__(self, rec: Recipe, budget: TuningBudget | None, cache: TrialCache | None, key: str):
        self.rec, self.budget, self.cache, self.key = rec, budget, cache, key
        self.hit = (cache.get(key) or {}) if cache is not None else {}
        self.new: dict = {}
        self.refused: dict[str, str] = {}

    def cached(self, part: str) -> dict | None:
        return self.hit.get(part)

    def measure(self, part: str, cost: int) -> bool:
        if part in self.hit:
            return False
        if self.budget is None or self.budget.allows(cost):
            if self.budget is not None:
                self.budget.spend(cost)
            return True
        self.refused[part] = self.budget.refusal(cost)
        return False

    def settle(self, part: str, field: str, prior, prior_words: str, *, default):
        """The value of `field` when `part` was not measured: cached, or the prior (`default`), with its Decision."""
        d = self.rec.decisions
        refused = self.refused.get(part)
        if part in self.hit:
            value = self.hit[part].get(field)
            d[part] = Decision(value if value is not None else prior, "cached: measured by an earlier run of this "
                               "model on this machine (0 steps now)", measured=self.hit[part])
            return value if value is not None else default
        d[part] = Decision(prior, f"prior: {prior_words}; not measured ({refused or 'part off'})")
        return default

    def done(self, part: str, values: dict) -> None:
        self.new[part] = values | {"decision": dict(self.rec.decisions.get(part) or {})}

    def save(self) -> None:
        if self.cache is not None and self.new:
            self.cache.put(self.key, self.hit | self.new)


def _choose_lr(model, loader, rec: Recipe, *, optimizer, name, schedule, loss_fn, lr_steps, lr_trial_steps, noise,
               weight_decay, optimizer_options, precision, step_fn, progress) -> dict:
    """The LR part (T14, T15): the range test, then a short one-cycle trial of its pick and 2x, 4x."""
    from torchspeed.train.optim import create_optimizer
    from torchspeed.tune.lr import find_lr

    scratch = optimizer if not isinstance(optimizer, str) else create_optimizer(
        name, model, lr=1e-6, weight_decay=weight_decay, **(optimizer_options or {}))
    res = find_lr(model, loader, loss_fn=loss_fn, step_fn=step_fn, optimizer=scratch, precision=precision,
                  num_steps=lr_steps, progress=progress)
    rec.tuning_steps += int(res.steps or len(res.lrs))
    onecycle = schedule == "onecycle"
    peak = float(res.max_lr if onecycle else res.suggestion)
    how = f"{'one-cycle peak' if onecycle else 'suggestion'} of the range test"
    measured = {"range_test_steps": int(res.steps or len(res.lrs)), "suggestion": res.suggestion,
                "bottom_lr": res.bottom_lr, "min_loss_lr": res.min_loss_lr, "range_test_pick": peak,
                "precision": precision}
    if onecycle and lr_trial_steps and not res.trial:  # the range test's pick and 2x, 4x: a short one-cycle each
        peak, how, extra = refine_onecycle_peak(model, loader, res, optimizer=optimizer, name=name,
                                                weight_decay=weight_decay, optimizer_options=optimizer_options,
                                                precision=precision, loss_fn=loss_fn, step_fn=step_fn,
                                                steps=lr_trial_steps, how=how,
                                                noise_batches=NOISE_BATCHES if noise else 0)
        rec.tuning_steps += extra.get("steps", 0)
        measured.update(extra)
    rec.lr = peak
    if onecycle:
        rec.min_lr = peak / 10
    rec.decisions["lr"] = Decision(rec.lr, f"{how} on {name or type(optimizer).__name__} ({res.rule}; confidence "
                                           f"{res.confidence}{': ' + res.warning if res.warning else ''}); floor "
                                           f"{rec.min_lr if rec.min_lr is not None else 'default'} (T14, T15)",
                                   measured=measured)
    return measured


def refine_onecycle_peak(model, loader, res, *, optimizer, name=None, weight_decay=None, optimizer_options=None,
                         precision="auto", loss_fn=None, step_fn=None, steps: int = 24,
                         how: str = "one-cycle peak of the range test", noise_batches: int = 0
                         ) -> tuple[float, str, dict]:
    """The range test's one-cycle pick, or 2x or 4x it when a short one-cycle of each says so (T14, T15).

    The range test's loss minimum lags the LR (the LR grows while the model is still
    learning), so on short SGD runs its pick sits 2-3x below the best peak of a sweep
    (docs/tune.md). Each candidate (capped below where the range test's loss climbed) trains
    `steps` steps as a one-cycle from the same state on the same batches; a higher peak is
    taken only when its final training loss is lower by more than LR_TRIAL_MARGIN. Returns
    (peak, how it was chosen, {"trial": table, "steps": steps spent}). With `noise_batches` > 0 the
    gradient noise scale is measured at the end of each candidate's run on that many of its batches, and
    the chosen peak's goes in as "noise_scale" (None when not measured). Under DDP rank 0 measures.
    """
    from torchspeed.tune._common import decide_once
    from torchspeed.tune.lr import trial_ceiling

    peak = float(res.max_lr)
    cands = sorted({peak * f for f in LR_TRIAL_FACTORS if peak * f <= max(peak, trial_ceiling(res))})
    if len(cands) < 2:
        return peak, how + " (no room above it for a trial: the loss climbed just past it)", {}
    rows = decide_once(lambda: _lr_trial(model, loader, cands, optimizer=optimizer, name=name,
                                         weight_decay=weight_decay, optimizer_options=optimizer_options,
                                         precision=precision, loss_fn=loss_fn, step_fn=step_fn, steps=steps,
                                         noise_batches=noise_batches))
    table = [(lr_, sc) for lr_, sc, _ in rows]
    noise = {lr_: ns for lr_, _, ns in rows}
    extra = {"trial": [[float(a), float(b)] for a, b in table], "steps": len(cands) * steps}
    best = min(table, key=lambda t: t[1])
    at_pick = min(sc for lr_, sc in table if lr_ == peak)
    if best[0] != peak and best[1] < at_pick * (1 - LR_TRIAL_MARGIN):
        extra["noise_scale"] = noise[best[0]]
        return best[0], (f"a short one-cycle trial ({len(cands)} peaks x {steps} steps from the same state, lowest "
                         f"training loss at the end) over the range test's pick {peak:.3g}"), extra
    extra["noise_scale"] = noise[peak]
    return peak, how + f" (kept by a short one-cycle trial of {len(cands)} peaks)", extra


def _onecycle_shape(i: int, n: int) -> float:
    """The LR trial's factor at step `i` of `n`: 25% linear warm-up from 1/10, then a cosine down to 1/100."""
    import math

    warm = max(1, n // 4)
    if i < warm:
        return 0.1 + 0.9 * i / warm
    return 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, n - warm)))


def _lr_trial(model, loader, peaks, *, optimizer, name, weight_decay, optimizer_options, precision, loss_fn, step_fn,
              steps: int, noise_batches: int = 0) -> list[tuple[float, float, float | None]]:
    """Each peak LR trained for `steps` steps as a one-cycle (`_onecycle_shape`) from the same state on the same
    batches; the score is the mean training loss over the last third (the range test's `_trial_run`). Rows are
    (peak, score, the noise scale at the end of its run on `noise_batches` of its batches, or None)."""
    from torchspeed.train.noise import measure_noise_scale
    from torchspeed.train.optim import create_optimizer
    from torchspeed.train.precision import make_grad_scaler, resolve_precision
    from torchspeed.tune._common import StateSnapshot, TrainStep, model_device
    from torchspeed.tune.lr import _batches, _trial_run

    device = model_device(model)
    prec = resolve_precision(precision, device=device)
    opt = optimizer if not isinstance(optimizer, str) else create_optimizer(
        name, model, lr=peaks[0], weight_decay=weight_decay, **(optimizer_options or {}))
    scaler = make_grad_scaler(prec) if prec.needs_scaler else None
    base = [g["lr"] for g in opt.param_groups]
    ratios = [b / base[0] if base[0] else 1.0 for b in base]

    def set_lr(lr: float) -> None:
        for g, r in zip(opt.param_groups, ratios):
            g["lr"] = lr * r

    snap = StateSnapshot(model, opt, None, scaler)
    it = _batches(loader, 64, 0)
    batches = [next(it) for _ in range(steps)]
    step = TrainStep(model, opt, loss_fn=loss_fn, precision=prec, step_fn=step_fn, scaler=scaler)
    table = []
    try:
        for peak in peaks:
            snap.restore()  # the same weights, optimizer state and RNG for every peak
            model.train()
            score = _trial_run(step, set_lr, peak, batches, device, shape=_onecycle_shape)
            noise = None
            if noise_batches:  # the weights a short run reached: the noise scale has grown from its start
                noise = measure_noise_scale(model, batches[:noise_batches], loss_fn=loss_fn,
                                            step_fn=step_fn).noise_scale
            table.append((float(peak), score, noise))
    finally:
        snap.restore()
    return table


def _choose_ema(rec: Recipe, total_steps: int | None, why: str = "") -> None:
    """The EMA part (T40): on for runs of EMA_MIN_STEPS+ steps, its average spanning about the last twentieth."""
    if total_steps and total_steps >= EMA_MIN_STEPS:
        rec.ema_decay = round(min(0.9999, max(0.99, 1 - 20 / total_steps)), 6)
        rec.decisions["ema"] = Decision(rec.ema_decay, f"a run of {total_steps} steps{why}: the average spans "
                                                       "about its last twentieth (T40)")
    else:
        rec.ema_decay = None
        rec.decisions["ema"] = Decision(None, f"run of {total_steps or 'unknown'} steps{why}, under {EMA_MIN_STEPS}: "
                                              "an average of so few steps gained nothing measured (docs/recipe.md)")


def _choose_batch(model, loader, rec: Recipe, *, optimizer, name, weight_decay, optimizer_options, precision,
                  loss_fn, step_fn, total_steps, noise_scale, progress) -> None:
    """The batch part (T17, tune/batch_choice.py): the batch with the least predicted time to a target, the LR
    (and floor) scaled to it."""
    import torch.distributed as dist

    from torchspeed.train.optim import create_optimizer
    from torchspeed.tune.batch_choice import choose_batch_size, scale_lr_for_batch

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    b0 = getattr(loader, "batch_size", None)
    long_run = total_steps is not None and total_steps >= BATCH_MIN_STEPS  # else it decides without measuring
    scratch = optimizer if not isinstance(optimizer, str) or not long_run else create_optimizer(
        name, model, lr=1e-6, weight_decay=weight_decay, **(optimizer_options or {}))
    new, dec = choose_batch_size(model, loader, total_steps=total_steps, noise_scale=noise_scale, optimizer=scratch,
                                 precision=precision, loss_fn=loss_fn, step_fn=step_fn, world_size=world,
                                 progress=progress)
    rec.decisions["batch_size"] = dec
    if new is None or not b0:
        return
    rec.batch_size = new
    if "ema" in rec.parts and total_steps:  # the run is shorter in steps at the larger batch
        _choose_ema(rec, max(1, total_steps * b0 // new), f" at batch {new}")
    kind = name or type(optimizer).__name__
    if rec.lr is not None:
        old = rec.lr
        rec.lr = scale_lr_for_batch(old, new, b0, kind)
        if rec.min_lr is not None:
            rec.min_lr = rec.min_lr * rec.lr / old
        prev = rec.decisions.get("lr")
        rule = "square root" if rec.lr / old != new / b0 else "linear"
        rec.decisions["lr"] = Decision(rec.lr, (prev.reason + "; then " if prev is not None else "") +
                                       f"{old:.3g} scaled to batch {new} by the {rule} rule for {kind} (T17)",
                                       measured=getattr(prev, "measured", None))


SF_REPLACES = ("sgd", "adamw")  # the plain optimizers a Schedule-Free candidate may replace
OPTIMIZER_TRIAL_STEPS = 50      # compare_optimizers: steps per candidate


def _choose_optimizer(model, loader, rec: Recipe, gate: _Gate, *, given: str, lr, schedule, precision, loss_fn,
                      step_fn, total_steps) -> None:
    """The optimizer parts (T42 Muon, T14's alternative Schedule-Free AdamW): the given optimizer or a candidate,
    compared on time to the same training loss when the budget allows (`compare_optimizers`), else the cache,
    else the prior: Schedule-Free AdamW, which needs neither an LR search nor a schedule."""
    from torchspeed.train.optim import (SCHEDULE_FREE_LR, matrix_share, mostly_matrices, schedule_free_available)

    d = rec.decisions
    cands = [given]
    why_not = []
    if "schedulefree" in rec.parts and given in SF_REPLACES:
        if schedule_free_available():
            cands.append("schedulefree")
        else:
            why_not.append("Schedule-Free not installed (pip install 'torchspeed[schedulefree]')")
    if "muon" in rec.parts and given == "adamw":
        if mostly_matrices(model):
            cands.append("muon")
        else:
            why_not.append(f"{matrix_share(model):.0%} of the weights are hidden 2D matrices (under half): Muon "
                           "not tried (T42)")
    if len(cands) == 1:
        if why_not:
            d["optimizer"] = Decision(given, "; ".join(why_not))
        return
    lrs = {n: SCHEDULE_FREE_LR if n == "schedulefree" else lr for n in cands}
    if gate.measure("optimizer", len(cands) * OPTIMIZER_TRIAL_STEPS):
        from torchspeed.tune.optimizer_trial import compare_optimizers

        trial = compare_optimizers(model, loader, tuple(cands), lr=lrs, precision=precision, loss_fn=loss_fn,
                                   step_fn=step_fn, schedule=schedule, steps=OPTIMIZER_TRIAL_STEPS, progress=False)
        rec.tuning_steps += int(trial.steps or 0) * len(cands)
        d["optimizer"] = Decision(trial.best, f"{trial.reason} (T42, Schedule-Free: T14's alternative)",
                                  measured={"table": [dict(r) for r in trial.table]})
        chosen = trial.best
        gate.done("optimizer", {"optimizer": chosen})
    else:
        prior = "schedulefree" if "schedulefree" in cands else given
        words = ("Schedule-Free AdamW at its default LR (needs no LR search and no schedule; AlgoPerf 2024's "
                 "self-tuning winner; on the digits bench it reached 0.97 in 48 steps against SGD one-cycle's 72, "
                 "docs/recipe.md)" if prior == "schedulefree" else f"{given}, as given")
        chosen = gate.settle("optimizer", "optimizer", prior, words, default=prior)
    rec.optimizer = None if chosen == given else chosen
    if rec.optimizer == "schedulefree":
        _schedule_free_parts(rec, total_steps)


def _schedule_free_parts(rec: Recipe, total_steps: int | None) -> None:
    """Schedule-Free AdamW replaces the LR search, the schedule's floor, the BatchNorm tail and the EMA: it averages
    its own weights and the Trainer recalibrates BatchNorm statistics for them."""
    from torchspeed.train.optim import SCHEDULE_FREE_LR

    d = rec.decisions
    rec.lr, rec.min_lr = SCHEDULE_FREE_LR, None
    if "lr" in rec.parts:
        d["lr"] = Decision(SCHEDULE_FREE_LR, "Schedule-Free AdamW's default LR; no range test (it needs no LR "
                                             "schedule; warm-up over the run's first twentieth)")
    if rec.bn_stats:
        rec.bn_stats = False
        d["bn_stats"] = Decision(False, "Schedule-Free: BatchNorm statistics are recalibrated for its averaged "
                                        "weights at evaluation instead (T47)")
    if rec.ema_decay is not None:
        rec.ema_decay = None
        d["ema"] = Decision(None, f"Schedule-Free averages its own weights: no EMA on top (run of {total_steps} "
                                  "steps)")


def choose_tta(model: nn.Module, batches: Sequence, *, device: torch.device | str | None = None,
               precision: str = "fp32", channels_last: bool = False, margin: float = 0.02) -> Decision:
    """Flip test-time augmentation (T33) when it scores better on `batches` (training batches).

    Only for image classifiers (4D inputs). "Better": a lower loss by more than `margin`
    (relative) and an accuracy at least as high. Digits, text, or a model that learnt
    orientation: refused. Returns a Decision with both scores measured.
    """
    from torchspeed.train.batch import split_batch
    from torchspeed.train.evaluate import evaluate

    if not batches:
        return Decision(None, "no training batches to measure on")
    inputs, target = split_batch(batches[0])
    x = inputs[0] if isinstance(inputs, tuple) and inputs else None
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or target is None:
        return Decision(None, "not an image classifier (4D inputs with targets): no flip")
    kw = dict(device=device, precision=precision, channels_last=channels_last)
    plain = evaluate(model, batches, **kw)
    flip = evaluate(model, batches, tta="flip", **kw)
    measured = {"plain": {"loss": plain["val_loss"], "acc": plain["val_acc"]},
                "flip": {"loss": flip["val_loss"], "acc": flip["val_acc"]}}
    better = (flip["val_loss"] < plain["val_loss"] * (1 - margin)
              and (flip["val_acc"] or 0) >= (plain["val_acc"] or 0))
    how = (f"training batches: loss {plain['val_loss']:.4f} plain vs {flip['val_loss']:.4f} with flips, "
           f"accuracy {plain['val_acc']:.3f} vs {flip['val_acc']:.3f}")
    return Decision("flip" if better else None, ("flip scores better on " if better else "flip does not score "
                                                 "better on ") + how, measured=measured)


def decide_tta(trainer, batches: Sequence) -> Decision:
    """`choose_tta` for a trained `Trainer` (the weights it evaluates: the EMA's when one is on), recorded in its
    decisions; a chosen TTA becomes its `config.tta` unless one was set. Under DDP rank 0 decides for every rank."""
    from torchspeed.tune._common import decide_once

    module = trainer.callbacks.eval_module(trainer.module)
    dec = decide_once(lambda: choose_tta(module, batches, device=trainer.device, precision=trainer.precision,
                                         channels_last=trainer.channels_last))
    trainer.decisions["tta"] = dec
    if dec.value and trainer.config.tta is None:
        trainer.config.tta = dec.value
    return dec
