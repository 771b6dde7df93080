"""The recipe's LR part (T14, T15): the range test run with the run's optimizer and precision, then a short
one-cycle trial of its pick and 2x, 4x (`refine_onecycle_peak`). `choose_recipe` calls it before the run, or
the `lr_in_run` stage (`plan.inrun.measure_lr_in_run`) right after the switch trial, at the precision that trial chose.
"""

from __future__ import annotations

import math

from torchspeed.plan.parts import Recipe
from torchspeed.train.decision import Decision
from torchspeed.train.noise import measure_noise_scale
from torchspeed.train.optim import create_optimizer
from torchspeed.train.precision import make_grad_scaler, resolve_precision
from torchspeed.train.sampler import take_batches
from torchspeed.tune._common import StateSnapshot, TrainStep, decide_once, model_device
from torchspeed.tune.lr import _trial_run, find_lr, trial_ceiling

__all__ = ["LR_TRIAL_FACTORS", "LR_TRIAL_MARGIN", "NOISE_BATCHES", "choose_lr_part", "refine_onecycle_peak"]

LR_TRIAL_FACTORS = (1.0, 2.0, 4.0)  # the one-cycle peaks the LR trial compares: the range test's pick, and above it
LR_TRIAL_MARGIN = 0.02              # a higher peak must lower the trial's final loss by more than this
NOISE_BATCHES = 8                   # batches of the LR trial's own on which the batch part's noise scale is measured


def choose_lr_part(model, loader, rec: Recipe, *, optimizer, name, schedule, loss_fn, lr_steps, lr_trial_steps, noise,
               weight_decay, optimizer_options, precision, step_fn, progress) -> dict:
    """The LR part (T14, T15): the range test, then a short one-cycle trial of its pick and 2x, 4x."""
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
    rec.decisions.refine("lr", Decision(rec.lr, f"{how} on {name or type(optimizer).__name__} ({res.rule}; confidence "
                                           f"{res.confidence}{': ' + res.warning if res.warning else ''}); floor "
                                           f"{rec.min_lr if rec.min_lr is not None else 'default'} (T14, T15)",
                                   measured=measured))  # (the in-run measurement refines its prior)
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
    opt = optimizer if not isinstance(optimizer, str) else create_optimizer(
        name, model, lr=peaks[0], weight_decay=weight_decay, **(optimizer_options or {}))
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
