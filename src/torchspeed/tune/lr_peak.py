"""The one LR chooser (T14, T15): the range test, then, for a one-cycle run, a short one-cycle trial of its pick and
2x, 4x. `lr="auto"` (the plan's `tune_lr` stage, `plan/tuners.py`) and the recipe's LR part (`plan.recipe_lr`,
before the run or in its first steps) both call `choose_peak_lr`, so one rule picks the LR whichever way it was
asked for.

- The range test (`tune.lr.find_lr`) with the run's optimizer and precision: its one-cycle pick
  (`max_lr`) for a one-cycle run, its suggestion for any other schedule.
- For a one-cycle run, `refine_onecycle_peak`: the range test's loss minimum lags the LR (the LR
  grows while the model is still learning), so on short SGD runs its pick sits 2-3x below the
  best peak of a sweep (docs/tune.md). Each candidate (the pick, 2x and 4x, capped below where
  the range test's loss climbed) trains `trial_steps` steps as a one-cycle from the same state on
  the same batches; a higher peak is taken only when its final training loss is lower by more
  than LR_TRIAL_MARGIN. Skipped where the range test's own fallback trial already decided.

Example:
    >>> choice = choose_peak_lr(model, loader, optimizer="sgd", schedule="onecycle", trial_steps=24)
    >>> choice.lr, choice.how, choice.steps
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchspeed.train.noise import measure_noise_scale
from torchspeed.train.trial.precision import make_grad_scaler, resolve_precision
from torchspeed.train.sampler import take_batches
from torchspeed.train.optim_candidate import candidate_optimizer
from torchspeed.tune._common import StateSnapshot, TrainStep, decide_once, model_device
from torchspeed.tune.lr import LRFinderResult, _trial_run, find_lr, trial_ceiling

__all__ = ["LR_TRIAL_FACTORS", "LR_TRIAL_MARGIN", "LR_TRIAL_STEPS", "PeakChoice", "choose_peak_lr",
           "refine_onecycle_peak"]

LR_TRIAL_FACTORS = (1.0, 2.0, 4.0)  # the one-cycle peaks the LR trial compares: the range test's pick, and above it
LR_TRIAL_MARGIN = 0.02              # a higher peak must lower the trial's final loss by more than this
LR_TRIAL_STEPS = 24                 # steps per peak in the trial


@dataclass
class PeakChoice:
    """The chosen LR, how it was chosen (words), what was measured, the range test's result and the steps spent."""

    lr: float
    how: str
    measured: dict
    result: LRFinderResult
    steps: int
    noise_scale: float | None = None

    @property
    def evidence(self) -> str:
        """The range test's rule and how far to trust it, in words (both callers' Decisions say it)."""
        r = self.result
        return f"{r.rule}; confidence {r.confidence}" + (f": {r.warning}" if r.warning else "")


def choose_peak_lr(model, loader, *, optimizer, name=None, schedule="onecycle", loss_fn=None, step_fn=None,
                   lr_steps: int = 100, trial_steps: int = LR_TRIAL_STEPS, weight_decay=None, optimizer_options=None,
                   precision="auto", noise_batches: int = 0, progress: bool = False) -> PeakChoice:
    """The LR for a run of `schedule`: the range test's pick, refined by a one-cycle trial on a one-cycle run
    (`trial_steps` 0: no trial). `optimizer` is the run's optimizer object or its name (`name` for a
    candidate built here); `noise_batches` > 0 measures the gradient noise scale where the chosen peak's trial
    run ended (the recipe's batch part reads it). The model, optimizer state and RNGs are left as they were."""
    scratch = candidate_optimizer(optimizer, model, lr=1e-6, name=name, weight_decay=weight_decay,
                                  options=optimizer_options)
    res = find_lr(model, loader, loss_fn=loss_fn, step_fn=step_fn, optimizer=scratch, precision=precision,
                  num_steps=lr_steps, progress=progress)
    steps = int(res.steps or len(res.lrs))
    onecycle = schedule == "onecycle"
    peak = float(res.max_lr if onecycle else res.suggestion)
    how = f"{'one-cycle peak' if onecycle else 'suggestion'} of the range test"
    measured = {"range_test_steps": steps, "suggestion": res.suggestion, "bottom_lr": res.bottom_lr,
                "min_loss_lr": res.min_loss_lr, "range_test_pick": peak, "precision": precision}
    noise = None
    if onecycle and trial_steps and not res.trial:  # the range test's pick and 2x, 4x: a short one-cycle each
        peak, how, extra = refine_onecycle_peak(model, loader, res, optimizer=optimizer, name=name,
                                                weight_decay=weight_decay, optimizer_options=optimizer_options,
                                                precision=precision, loss_fn=loss_fn, step_fn=step_fn,
                                                steps=trial_steps, how=how, noise_batches=noise_batches)
        steps += extra.get("steps", 0)
        noise = extra.get("noise_scale")
        measured.update(extra)
    return PeakChoice(peak, how, measured, res, steps, noise)


def refine_onecycle_peak(model, loader, res, *, optimizer, name=None, weight_decay=None, optimizer_options=None,
                         precision="auto", loss_fn=None, step_fn=None, steps: int = LR_TRIAL_STEPS,
                         how: str = "one-cycle peak of the range test", noise_batches: int = 0
                         ) -> tuple[float, str, dict]:
    """The range test's one-cycle pick, or 2x or 4x it when a short one-cycle of each says so (T14, T15).

    Returns (peak, how it was chosen, {"trial": table, "steps": steps spent}). With `noise_batches` > 0 the
    gradient noise scale is measured at the end of each candidate's run on that many of its batches, and
    the chosen peak's goes in as "noise_scale" (None when not measured). Under DDP rank 0 measures.
    """
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
    warm = max(1, n // 4)
    if i < warm:
        return 0.1 + 0.9 * i / warm
    return 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, n - warm)))


def _lr_trial(model, loader, peaks, *, optimizer, name, weight_decay, optimizer_options, precision, loss_fn, step_fn,
              steps: int, noise_batches: int = 0) -> list[tuple[float, float, float | None]]:
    """Each peak LR trained for `steps` steps as a one-cycle (`_onecycle_shape`) from the same state on the same
    batches; the score is the mean training loss over the last third (the range test's `_trial_run`). Rows are
    (peak, score, the noise scale at the end of its run on `noise_batches` of its batches, or None)."""
    device = model_device(model)
    prec = resolve_precision(precision, device=device)
    opt = candidate_optimizer(optimizer, model, lr=peaks[0], name=name, weight_decay=weight_decay,
                              options=optimizer_options)
    scaler = make_grad_scaler(prec) if prec.needs_scaler else None
    base = [g["lr"] for g in opt.param_groups]
    ratios = [b / base[0] if base[0] else 1.0 for b in base]

    def set_lr(lr: float) -> None:
        for g, r in zip(opt.param_groups, ratios):
            g["lr"] = lr * r

    snap = StateSnapshot(model, opt, None, scaler)
    batches = take_batches(loader, steps, batch_size=64, cycle=True, what="the data for the LR trial")
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
