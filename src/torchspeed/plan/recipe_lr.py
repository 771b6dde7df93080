"""The recipe's LR part (T14, T15): `tune.lr_peak.choose_peak_lr`, the one LR chooser (`lr="auto"` calls it too),
run with the run's optimizer and precision. The plan's "lr" stage (`lr_part`) decides it within the tuning budget:
left pending for the `lr_in_run` stage (`plan.inrun.measure_lr_in_run`), which measures it right after the switch
trial at the precision that trial chose; measured here; read from the cache; or kept at the given peak. Where the
optimizer part chose Schedule-Free AdamW, its LR is a rule of the model's width and nothing is measured.
"""

from __future__ import annotations

from torchspeed.plan.parts import Gate, Recipe, guarded, loss_for_tuning
from torchspeed.plan.stages import RunContext
from torchspeed.train.decision import Decision
from torchspeed.train.optim_info import default_lr
from torchspeed.tune.batch_choice import BATCH_MIN_STEPS
from torchspeed.tune.lr_peak import LR_TRIAL_FACTORS, choose_peak_lr

__all__ = ["NOISE_BATCHES", "LR_STEPS", "LR_TRIAL_STEPS", "choose_lr_part", "lr_part"]

NOISE_BATCHES = 8  # batches of the LR trial's own on which the batch part's noise scale is measured
LR_STEPS = 100  # the range test's steps
LR_TRIAL_STEPS = 24  # each one-cycle trial candidate's steps


def choose_lr_part(model, loader, rec: Recipe, *, optimizer, name, schedule, loss_fn, lr_steps, lr_trial_steps, noise,
                   weight_decay, optimizer_options, precision, step_fn, progress) -> tuple[dict, Decision]:
    """The LR part: the peak (and, for a one-cycle run, its floor, a tenth of it) from the one LR chooser, set on
    `rec`; returns what it measured and its Decision (the caller decides the key, or refines the prior with it)."""
    choice = choose_peak_lr(model, loader, optimizer=optimizer, name=name, schedule=schedule, loss_fn=loss_fn,
                            step_fn=step_fn, lr_steps=lr_steps, trial_steps=lr_trial_steps,
                            weight_decay=weight_decay, optimizer_options=optimizer_options, precision=precision,
                            noise_batches=NOISE_BATCHES if noise else 0, progress=progress)
    rec.tuning_steps += choice.steps
    rec.lr = choice.lr
    if schedule == "onecycle":
        rec.min_lr = choice.lr / 10
    return choice.measured, Decision(rec.lr, f"{choice.how} on {name or type(optimizer).__name__} "
                                             f"({choice.evidence}); floor "
                                             f"{rec.min_lr if rec.min_lr is not None else 'default'} (T14, T15)",
                                     measured=choice.measured)


def lr_part(ctx: RunContext) -> None:
    """The "lr" stage: the LR the optimizer part set (Schedule-Free's, or the width rule's for a prior measured
    with it), else the LR part within the budget
    (guarded: a measurement that raises keeps the given peak). What it measured (the noise scale, for the batch
    part) goes to `ctx.shared.found`."""
    rec = ctx.rec
    if "optimizer_lr" in ctx.shared.found:  # the optimizer part set it: Schedule-Free's, or the prior's width rule
        lr, why = ctx.shared.found["optimizer_lr"]  # (the optimizer part set rec.lr to it)
        ctx.decisions["lr"] = Decision(lr, f"{why}; no range test" + (
            " (it needs no LR schedule; warm-up over the run's first twentieth)" if rec.optimizer == "schedulefree"
            else ""))
        return
    lr, cfg = float(ctx.lr), ctx.cfg
    name = rec.optimizer or (ctx.optimizer if isinstance(ctx.optimizer, str) else None)
    if rec.optimizer and rec.optimizer != ctx.optimizer and not ctx.own_lr:  # the optimizer part swapped it:
        lr = rec.lr = default_lr(rec.optimizer)  # its own default LR is the prior, as its trial measured it
    batch_wanted = "batch" in rec.parts and ctx.run_steps is not None and ctx.run_steps >= BATCH_MIN_STEPS
    measured = guarded(rec, "lr", dict(lr=lr, min_lr=None), lr, _lr_part, ctx.model, ctx.planned_loader(), rec,
                       ctx.shared.gate, optimizer=ctx.optimizer, name=name, lr=lr, schedule=cfg.schedule,
                       loss_fn=loss_for_tuning(ctx), lr_steps=LR_STEPS, lr_trial_steps=LR_TRIAL_STEPS,
                       noise=batch_wanted, in_run=cfg.trial is not False and not cfg.deterministic,
                       weight_decay=ctx.weight_decay, optimizer_options=ctx.optimizer_options,
                       precision=ctx.precision or cfg.precision, step_fn=ctx.step_fn, progress=cfg.progress)
    ctx.shared.found["noise_scale"] = (measured or {}).get("noise_scale")


def _lr_part(model, loader, rec: Recipe, gate: Gate, *, optimizer, name, lr, schedule, loss_fn, lr_steps,
             lr_trial_steps, noise, in_run, **tuners) -> dict:
    """The LR part within the budget: left for the run to measure after its switch trial (`in_run`), measured here,
    or read from the cache or kept at the given peak. Returns what the measurement found (the noise scale)."""
    lr_cost = lr_steps + (len(LR_TRIAL_FACTORS) * lr_trial_steps if schedule == "onecycle" else 0)
    if in_run and gate.measure("lr", lr_cost):
        rec.pending["lr"] = {"cost": lr_cost, "key": gate.key, "lr_steps": lr_steps, "lr_trial_steps": lr_trial_steps}
        rec.min_lr = lr / 10 if schedule == "onecycle" else None  # rescaled with the measured peak
        rec.decisions["lr"] = Decision(lr, f"prior {lr:g} for the first steps; measured in the run right after the "
                                           "switch trial, at the precision it chooses "
                                           f"(~{lr_cost} steps off the run, within the budget)")
        return {}
    if gate.measure("lr", lr_cost):
        measured, rec.decisions["lr"] = choose_lr_part(model, loader, rec, optimizer=optimizer, name=name,
                                                       schedule=schedule, loss_fn=loss_fn, lr_steps=lr_steps,
                                                       lr_trial_steps=lr_trial_steps, noise=noise, **tuners)
        gate.done("lr", {"lr": rec.lr, "min_lr": rec.min_lr})
        return measured
    rec.lr = gate.settle("lr", "lr", lr, f"the given peak LR {lr:g}", default=lr)
    cached = gate.cached("lr")
    rec.min_lr = cached.get("min_lr") if cached else None
    return {}
