"""Recipe parts measured inside the run, after its switch trial: at the precision and layout it trains with (T14,
T15, T18, T21, T23).

The switch trial decides in the run's first steps (`train.trial.autoswitch`). A tuner that ran
before it would measure at the rule's precision, which the trial may overturn. So the plan
leaves an affordable LR part pending (its "lr" stage, `plan.recipe_lr.lr_part`), and the "lr_in_run" stage
(`measure_lr_in_run`, an "after_switches" stage of `plan.stages`) runs it once at the first step end
after the switch trial has settled: the range
test and the short one-cycle trial on the live model (its weights, optimizer state and every
RNG restored afterwards; the loader's data order untouched), with the precision in effect.
The run's schedule is then rescaled to the measured peak (`schedule.rescale_lr`) and the
measurement is cached for the next run of this model.

Example:
    >>> plan = make_plan(model, loader, TrainConfig(epochs=20), recipe="auto")   # the LR left pending
    >>> [s.name for s in stages("after_switches") if s.wanted(plan.context)]
    ['lr_in_run']
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from torch.utils.data import DataLoader

from torchspeed.plan.parts import guarded
from torchspeed.plan.recipe_lr import choose_lr_part
from torchspeed.train.losses import default_loss
from torchspeed.train.decision import Decision
from torchspeed.train.sampler import keep_rng, rebuild_loader
from torchspeed.train.schedule import rescale_lr

__all__ = ["measure_lr_in_run"]


def _tuning_loader(loader: Iterable) -> Iterable:
    """A loader the tuners may iterate beside the run's own iterator: persistent workers would be reset by a second
    `iter()`, so such a DataLoader is rebuilt without them (same dataset, sampler and generator)."""
    if isinstance(loader, DataLoader) and loader.num_workers > 0 and loader.persistent_workers:
        return rebuild_loader(loader, persistent_workers=False)
    return loader


def measure_lr_in_run(ctx) -> None:
    """The "lr_in_run" stage: the recipe's pending LR part, measured on the live model once the switch trial has
    decided, and put into effect; a measurement that raises is reported and the run keeps the prior LR."""
    rec, trainer = ctx.rec, ctx.trainer
    pending = rec.pending.pop("lr")
    prior = {"lr": rec.lr, "min_lr": rec.min_lr}  # the tuner restored the model: the prior LR stands
    if not guarded(rec, "lr", prior, rec.lr, _lr, ctx, pending):
        trainer.decisions.refine("lr", rec.decisions["lr"])


def _lr(ctx, pending: dict) -> bool:
    rec, trainer = ctx.rec, ctx.trainer
    before = float(rec.lr)
    precision = trainer.precision.name
    loss_fn = ctx.loss_fn or (default_loss(rec.label_smoothing) if rec.label_smoothing else None)
    t0 = time.perf_counter()
    with keep_rng(ctx.loader):
        measured, dec = choose_lr_part(trainer.module, _tuning_loader(ctx.loader), rec, optimizer=ctx.optimizer,
                                       name=ctx.optimizer if isinstance(ctx.optimizer, str) else None,
                                       schedule=ctx.cfg.schedule, loss_fn=loss_fn, lr_steps=pending["lr_steps"],
                                       lr_trial_steps=pending["lr_trial_steps"], noise=False,
                                       weight_decay=ctx.weight_decay, optimizer_options=ctx.optimizer_options,
                                       precision=precision, step_fn=ctx.step_fn, progress=ctx.cfg.progress)
    seconds = time.perf_counter() - t0
    factor = rec.lr / before if before else 1.0
    rescale_lr(trainer.optimizer, trainer.scheduler, factor)
    trainer.decisions.refine("lr", Decision(rec.lr, f"{dec.reason}; measured at step {trainer.step}, after the switch "
                                                    f"trial, in {precision}: the schedule rescaled x{factor:.3g} "
                                                    f"from the prior {before:g}",
                                            measured=(measured or {}) | {"seconds": seconds}))
    tuning = trainer.decisions.get("tuning")
    if tuning is not None and tuning.measured is not None:
        tuning.measured["in_run_s"] = seconds
        tuning.measured["in_run_steps"] = pending["cost"]
    if ctx.cache is not None:
        ctx.cache.merge(pending["key"], {"lr": {"lr": rec.lr, "min_lr": rec.min_lr,
                                                "decision": dict(trainer.decisions["lr"])}})
    return True
