"""The recipe's LR part (T14, T15): `tune.lr_peak.choose_peak_lr`, the one LR chooser (`lr="auto"` calls it too),
run with the run's optimizer and precision. `choose_recipe` calls it before the run, or the `lr_in_run` stage
(`plan.inrun.measure_lr_in_run`) right after the switch trial, at the precision that trial chose.
"""

from __future__ import annotations

from torchspeed.plan.parts import Recipe
from torchspeed.train.decision import Decision
from torchspeed.tune.lr_peak import choose_peak_lr

__all__ = ["NOISE_BATCHES", "choose_lr_part"]

NOISE_BATCHES = 8  # batches of the LR trial's own on which the batch part's noise scale is measured


def choose_lr_part(model, loader, rec: Recipe, *, optimizer, name, schedule, loss_fn, lr_steps, lr_trial_steps, noise,
                   weight_decay, optimizer_options, precision, step_fn, progress) -> dict:
    """The LR part: the peak (and, for a one-cycle run, its floor, a tenth of it) from the one LR chooser."""
    choice = choose_peak_lr(model, loader, optimizer=optimizer, name=name, schedule=schedule, loss_fn=loss_fn,
                            step_fn=step_fn, lr_steps=lr_steps, trial_steps=lr_trial_steps,
                            weight_decay=weight_decay, optimizer_options=optimizer_options, precision=precision,
                            noise_batches=NOISE_BATCHES if noise else 0, progress=progress)
    rec.tuning_steps += choice.steps
    rec.lr = choice.lr
    if schedule == "onecycle":
        rec.min_lr = choice.lr / 10
    rec.decisions.refine("lr", Decision(rec.lr, f"{choice.how} on {name or type(optimizer).__name__} "
                                                f"({choice.evidence}); floor "
                                                f"{rec.min_lr if rec.min_lr is not None else 'default'} (T14, T15)",
                                        measured=choice.measured))  # (the in-run measurement refines its prior)
    return choice.measured
