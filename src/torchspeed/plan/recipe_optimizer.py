"""The recipe's optimizer parts: Muon for the hidden matrices (T42) and Schedule-Free AdamW (T14's alternative: no LR
schedule and no LR search). Each is a candidate against the optimizer the run was given, compared by
`tune.optimizer_trial.compare_optimizers` on time to the same training loss when the tuning budget allows; else
an earlier run's measurement (the cache); else the prior, by the run's length and the model's kind
(`plan/recipe_horizon.py`, measured: AdamW with warmup-stable-decay for a language model, Schedule-Free AdamW for
every other kind). The plan's "optimizer" stage (`optimizer_part`) runs them for a run given its optimizer by name.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torchspeed.plan.parts import Gate, Recipe, guarded
from torchspeed.plan.recipe_horizon import horizon_prior, prior_parts
from torchspeed.plan.stages import RunContext
from torchspeed.train.decision import Decision
from torchspeed.train.optim import (matrix_share, mostly_matrices, schedule_free_available, schedule_free_lr,
                                    sparse_gradients)
from torchspeed.train.optim_info import optimizer_info
from torchspeed.tune.optimizer_trial import compare_optimizers

__all__ = ["SF_REPLACES", "OPTIMIZER_TRIAL_STEPS", "choose_optimizer_part", "optimizer_part", "wants_optimizer"]

SF_REPLACES = ("sgd", "adamw")  # the plain optimizers a Schedule-Free candidate may replace
OPTIMIZER_TRIAL_STEPS = 50      # compare_optimizers: steps per candidate


def choose_optimizer_part(model, loader, rec: Recipe, gate: Gate, *, given: str, lr, schedule, precision, loss_fn,
                          step_fn, total_steps, lr_given: bool = False, weight_decay: float | None = None,
                          optimizer_options: dict | None = None) -> tuple[float, str] | None:
    """The optimizer parts (T42 Muon, T14's alternative Schedule-Free AdamW): the given optimizer or a candidate,
    compared on time to the same training loss when the budget allows (`compare_optimizers`), else the cache,
    else the prior: Schedule-Free AdamW, which needs neither an LR search nor a schedule; or, when the run gave its
    own LR (`lr_given`), the given optimizer at that LR: the user's loop is a recipe auto could have chosen, and
    auto replaces it only on a measurement. Returns the LR the choice sets and why (the LR part says so):
    Schedule-Free's where it was chosen, the width rule's where the prior names it ("adamw+wsd+width"); else None."""
    d = rec.decisions
    cands = [given]
    why_not = []
    if (kept := _no_candidate(model)) is not None:
        d["optimizer"] = Decision(given, kept)
        return None
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
        return None
    sf_lr = schedule_free_lr(model)  # Schedule-Free's LR for this model's width, as candidate and as prior
    lrs = {n: lr if n == given else sf_lr[0] if n == "schedulefree" else optimizer_info(n).default_lr or lr
           for n in cands}
    measured = False
    if gate.measure("optimizer", len(cands) * OPTIMIZER_TRIAL_STEPS):
        trial = compare_optimizers(model, loader, tuple(cands), lr=lrs, precision=precision, loss_fn=loss_fn,
                                   step_fn=step_fn, schedule=schedule, steps=OPTIMIZER_TRIAL_STEPS, progress=False,
                                   weight_decay=weight_decay, optimizer_options=optimizer_options)
        rec.tuning_steps += int(trial.steps or 0) * len(cands)
        d["optimizer"] = Decision(trial.best, f"{trial.reason} (T42, Schedule-Free: T14's alternative)",
                                  measured={"table": [dict(r) for r in trial.table]})
        chosen, measured = trial.best, True
        gate.done("optimizer", {"optimizer": chosen})
    else:
        swaps = cands + (["adamw"] if given == "sgd" and "schedulefree" in cands else [])
        prior, words, schedule, width = _prior(model, swaps, given, lr_given, total_steps)
        chosen = gate.settle("optimizer", "optimizer", prior, words, default=prior)
        if chosen == prior and gate.cached("optimizer") is None and chosen != "schedulefree":
            rec.schedule = schedule  # the prior's own schedule, and its LR where it is the width rule's
            if width:  # (the LR part says so)
                rec.optimizer, rec.lr, rec.min_lr = (None if chosen == given else chosen), sf_lr[0], None
                return sf_lr[0], f"the width rule's LR, as the optimizer prior was measured with it: {sf_lr[1]}"
    rec.optimizer = None if chosen == given else chosen
    if rec.optimizer != "schedulefree":
        return None
    # taken whole when neither a trial nor the cache chose it: the prior
    _schedule_free_parts(rec, total_steps, sf_lr, whole=not measured and gate.cached("optimizer") is None)
    return sf_lr


def _no_candidate(model) -> str | None:
    """Why no candidate can replace the given optimizer on this model, if one cannot."""
    if sparse_gradients(model):  # Schedule-Free's, Muon's and AdamW's steps refuse sparse gradients
        return ("the model makes sparse gradients (an embedding with sparse=True): only optimizers that take them "
                "(SGD, SparseAdam, Adagrad), no candidate tried")
    if any(p.dtype == torch.float16 for p in model.parameters()):  # `model.half()`: no float32 master weights
        return ("the model's weights are float16: an Adam-family step (Schedule-Free's, AdamW's, Muon's) divides by "
                "sqrt(v) + eps, and its eps (1e-8) is 0 in float16; no candidate tried")
    return None


def _prior(model, cands: list[str], given: str, lr_given: bool,
           total_steps: int | None) -> tuple[str, str, str | None, bool]:
    """The optimizer a run takes unmeasured, why, the schedule it takes with it (None: the plan's) and whether its
    LR is the width rule's: the given one at the LR the run gave; else the one the horizon table
    (`recipe_horizon.PRIOR`: measured by run length and model kind) names, with the table's schedule and LR rule
    ("adamw+wsd+width"), where it may be taken (`cands`: a candidate, or AdamW for SGD where Schedule-Free could
    replace it), else Schedule-Free AdamW where it is a candidate, else the given optimizer."""
    if lr_given:
        return given, f"{given} at the LR you gave (your loop stands until a trial beats it)", None, False
    pick, why = horizon_prior(model, total_steps)
    name, schedule, width = prior_parts(pick) if pick else (None, None, False)
    if name not in cands:  # the table's winner may not replace this optimizer here (SGD for AdamW): the incumbent
        why += f"; {name} is not a candidate for {given}" if name else ""
        name, schedule, width = ("schedulefree" if "schedulefree" in cands else given), None, False
    at = "at the width rule's LR" if width else "at its default LR"
    words = ("Schedule-Free AdamW, its LR set by the model's width (needs no LR search and no schedule)"
             if name == "schedulefree" else f"{given}, as given, {at}" if name == given
             else f"{name} in place of {given}, {at}")
    words += f", with the {SCHEDULE_WORDS.get(schedule, schedule)} schedule" if schedule else ""
    return name, f"{words}: {why}", schedule, width


SCHEDULE_WORDS = {"wsd": "warmup-stable-decay", "linear": "linear-decay-to-zero"}


def _schedule_free_parts(rec: Recipe, total_steps: int | None, sf_lr: tuple[float, str], *,
                         whole: bool = False) -> None:
    """Schedule-Free AdamW replaces the LR search, the schedule's floor, the BatchNorm tail and the EMA: it averages
    its own weights and the Trainer recalibrates BatchNorm statistics for them. `sf_lr`: its LR and why
    (`schedule_free_lr`). `whole`: taken as the prior (not measured), it is taken whole, as the fixed recipe it
    is: no label smoothing on top, which nothing measured."""
    d = rec.decisions
    rec.lr, rec.min_lr = sf_lr[0], None  # (the LR stage, `recipe_lr.lr_part`, says so)
    if rec.bn_stats:
        rec.bn_stats = False
        d.refine("bn_stats", Decision(False, "Schedule-Free: BatchNorm statistics are recalibrated for its averaged "
                                             "weights at evaluation instead (T47)"))
    if whole and rec.label_smoothing:
        rec.label_smoothing = 0.0
        d.refine("label_smoothing", Decision(0.0, "Schedule-Free AdamW taken whole as the prior: no label smoothing "
                                                  "on top (a part is added to a prior only where measured)"))
    if rec.ema_decay is not None:
        rec.ema_decay = None
        d.refine("ema", Decision(None, f"Schedule-Free averages its own weights: no EMA on top (run of {total_steps} "
                                       "steps)"))


def wants_optimizer(ctx: RunContext) -> bool:
    """The "optimizer" stage's `when`: a recipe with Muon or Schedule-Free as a part, for an optimizer given by name
    (an optimizer object is the user's, kept)."""
    return ctx.rec is not None and isinstance(ctx.optimizer, str) and bool({"muon", "schedulefree"} &
                                                                            set(ctx.rec.parts))


def optimizer_part(ctx: RunContext) -> None:
    """The "optimizer" stage: `choose_optimizer_part` on the run's model and loader, guarded (a trial that raises
    leaves the given optimizer at its LR)."""
    rec, lr = ctx.rec, float(ctx.lr)
    sf_lr = guarded(rec, "optimizer", dict(optimizer=None, lr=lr, min_lr=None), ctx.optimizer, choose_optimizer_part,
                    ctx.model, ctx.planned_loader(), rec, ctx.shared.gate, given=ctx.optimizer, lr=lr,
                    schedule=ctx.cfg.schedule, precision=ctx.precision or ctx.cfg.precision, loss_fn=ctx.loss_fn,
                    step_fn=ctx.step_fn, total_steps=ctx.run_steps, lr_given=ctx.own_lr,
                    weight_decay=ctx.weight_decay, optimizer_options=ctx.optimizer_options)
    if sf_lr is not None:  # Schedule-Free's LR, or the prior's where it is the width rule's
        ctx.shared.found["optimizer_lr"] = sf_lr
    if rec.schedule and rec.schedule != ctx.cfg.schedule:  # the prior's schedule, for the LR part and the run
        if ctx.schedule_given:
            ctx.decisions.refine("optimizer", Decision(ctx.decisions["optimizer"].value, ctx.decisions[
                "optimizer"].reason + f"; your schedule ({ctx.cfg.schedule}) kept in place of {rec.schedule}"))
            rec.schedule = None
        else:
            ctx.cfg = replace(ctx.cfg, schedule=rec.schedule)
            ctx.decisions.refine("schedule", Decision(rec.schedule, "the optimizer prior's schedule, measured with it "
                                                                    "by run length and model kind (docs/recipe.md)"))
