"""The tuners as plan stages (T06-T08, T15, T17): `fit(..., batch_size=, lr="auto", loader="auto")`, measured by
`tune/auto.py`. In `BUILT_IN`'s order: `tuners` checks the options (a bad one is an error) and moves the model to
the run's device; `tune_batch` decides the batch, `tune_lr` the peak LR at that batch (measured, or a given LR
scaled to it), `tune_loader` the DataLoader settings at it. The batch and the settings go to
`ctx.loader_changes`: the stages after read the loader at them (`RunContext.planned_loader`) and the plan's last
"before" stage, `loader`, builds the run's loader with them once.

Example:
    >>> plan = make_plan(model, loader, TrainConfig(), batch_size=64, lr=0.1)   # tune_lr scales the LR to 64
    >>> plan.decisions["lr"], plan.loader.batch_size
"""

from __future__ import annotations

from torchspeed.plan.stages import RunContext, run_length
from torchspeed.tune.auto import check_options, scratch_optimizers, tune_batch, tune_lr, tuned_loader

__all__ = ["wants_tuners", "tuners_setup", "batch_tuner", "lr_tuner", "loader_tuner"]


def wants_tuners(ctx: RunContext) -> bool:
    """Whether fit asked for a tuner (`batch_size=`, `lr="auto"`, `loader=`)."""
    return ctx.batch_size is not None or ctx.lr == "auto" or ctx.loader_mode is not None


def _measure(ctx: RunContext) -> dict:
    return dict(loss_fn=ctx.loss_fn, step_fn=ctx.step_fn, precision=ctx.precision or ctx.cfg.precision,
                progress=ctx.cfg.progress)


def _scratch(ctx: RunContext):
    return scratch_optimizers(ctx.model, ctx.optimizer, weight_decay=ctx.weight_decay, options=ctx.optimizer_options)


def tuners_setup(ctx: RunContext) -> None:
    """The "tuners" stage: the options checked before any tuner measures; the model on the run's device."""
    check_options(ctx.loader, batch_size=ctx.batch_size, lr=ctx.lr, loader=ctx.loader_mode)
    ctx.model.to(ctx.dev)


def batch_tuner(ctx: RunContext) -> None:
    """The "tune_batch" stage: `batch_size="auto"` measured by the one batch chooser at the run's length (at the
    loader's batch), or the int given; a new batch for the loader."""
    new, decided = tune_batch(ctx.model, ctx.loader, ctx.batch_size, _scratch(ctx),
                              total_steps=run_length(ctx.loader, ctx.cfg), **_measure(ctx))
    ctx.decisions.update(decided)
    if new != getattr(ctx.loader, "batch_size", None):
        ctx.loader_changes = ctx.loader_changes | {"batch_size": new}


def lr_tuner(ctx: RunContext) -> None:
    """The "tune_lr" stage: `lr="auto"` measured at the run's batch, or the LR given scaled to a new batch."""
    old = getattr(ctx.loader, "batch_size", None)
    new = ctx.loader_changes.get("batch_size", old)
    ctx.lr, decided = tune_lr(ctx.model, ctx.planned_loader() if ctx.lr == "auto" else ctx.loader, ctx.lr,
                              _scratch(ctx), optimizer=ctx.optimizer, schedule=ctx.cfg.schedule, batches=(old, new),
                              **_measure(ctx))
    if _recipe_decides_lr(ctx) and "lr" in decided:
        # fit(recipe="auto", recipe_parts=(..., "lr")) with its own LR and batch_size=: the recipe's LR part decides
        # "lr" (and so the peak), and the given LR scaled to the batch is its prior, kept as "lr_scaled"
        decided["lr_scaled"] = decided.pop("lr")
        decided.pop("peak_lr", None)
    ctx.decisions.update(decided)


def _recipe_decides_lr(ctx: RunContext) -> bool:
    return ctx.recipe == "auto" and ctx.recipe_parts is not None and "lr" in ctx.recipe_parts


def loader_tuner(ctx: RunContext) -> None:
    """The "tune_loader" stage: `loader="auto"`, the DataLoader settings measured at the run's batch."""
    batch = ctx.loader_changes.get("batch_size", getattr(ctx.loader, "batch_size", None))
    settings, ctx.decisions["loader"] = tuned_loader(ctx.model, ctx.loader, batch, loss_fn=ctx.loss_fn, device=ctx.dev,
                                                     progress=ctx.cfg.progress)
    if settings:
        ctx.loader_changes = ctx.loader_changes | settings
