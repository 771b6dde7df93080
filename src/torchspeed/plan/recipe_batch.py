"""The recipe's batch part (T17; `tune/batch_choice.py`): for runs of at least `BATCH_MIN_STEPS` steps, the batch
with the least predicted time to a target, the LR (and floor) scaled to it by the optimizer's rule, and the EMA
reconsidered for the run, shorter in steps at the larger batch. The plan's "batch" stage (`batch_part`) prices it
in the run's steps from a timed forward and backward pass (`batch_cost`) and measures it within the tuning budget,
else reads the cache or keeps the loader's batch; the "loader" stage rebuilds the DataLoader at the chosen batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from torchspeed.plan.parts import Recipe, choose_ema, guarded, loss_for_tuning
from torchspeed.plan.stages import RunContext
from torchspeed.train.decision import Decision
from torchspeed.train.noise import measure_noise_scale
from torchspeed.train.optim_candidate import candidate_optimizer
from torchspeed.train.schedule import scale_lr_for_batch
from torchspeed.tune._common import decide_once
from torchspeed.tune.batch_choice import BATCH_MIN_STEPS, choose_run_batch

__all__ = ["BATCH_COST", "BATCH_FLOOR_S", "batch_cost", "step_seconds", "choose_batch", "batch_part"]

# Training steps off the run that the part costs (the budget's currency)
BATCH_COST = 150          # the batch timing's ~60 steps, most at 2-4x the batch, and the noise batches
BATCH_FLOOR_S = 0.9       # plus find_batch_size's timing floors: ~3 sizes x 3 rounds x its min_time (0.1 s)


def batch_cost(step_s: float | None) -> int:
    """The batch part's cost in the run's steps at `step_s` seconds a step (None: not timed): BATCH_COST, and its
    timing's floor of BATCH_FLOOR_S seconds in steps. Priced in steps alone it cost a 1,250-step run of 7 ms
    steps (a character GRU) 1.5-2.6 s, over half the run, against a budget of 5%."""
    return BATCH_COST + (math.ceil(BATCH_FLOOR_S / max(step_s, 1e-4)) if step_s else 0)


def step_seconds(model: nn.Module, batch, *, loss_fn: Callable | None, step_fn: Callable | None) -> float | None:
    """Seconds of a forward and backward pass over `batch`: the second of two (the first holds one-off work).
    Nothing is trained (`measure_noise_scale` leaves the model as it was). None: the batch cannot be split."""
    try:
        measure_noise_scale(model, [batch], batches=1, loss_fn=loss_fn, step_fn=step_fn)
        t0 = time.perf_counter()
        measure_noise_scale(model, [batch], batches=1, loss_fn=loss_fn, step_fn=step_fn)
    except Exception:  # a batch the noise measurement cannot read: priced in steps alone
        return None
    return time.perf_counter() - t0


def batch_part(ctx: RunContext) -> None:
    """The "batch" stage: timed and measured where the budget affords it at its price, else cached or the loader's
    batch; a run too short for it decides without measuring (guarded: a part that raises keeps the batch)."""
    rec, gate, model = ctx.rec, ctx.shared.gate, ctx.model
    total_steps = ctx.run_steps
    loss_fn = loss_for_tuning(ctx)
    batch_wanted = total_steps is not None and total_steps >= BATCH_MIN_STEPS
    cost = BATCH_COST  # timed only where the budget would afford the part at that price
    if batch_wanted and gate.cached("batch_size") is None and (gate.budget is None or gate.budget.allows(cost)):
        cost = batch_cost(decide_once(lambda: step_seconds(model, rec.probe[0], loss_fn=loss_fn, step_fn=ctx.step_fn)))
    if batch_wanted and not gate.measure("batch_size", cost):
        rec.batch_size = gate.settle("batch_size", "batch_size", None, "the loader's batch", default=None)
        return
    name = rec.optimizer or (ctx.optimizer if isinstance(ctx.optimizer, str) else None)
    guarded(rec, "batch_size", dict(batch_size=None, lr=rec.lr, min_lr=rec.min_lr), None, choose_batch, model,
            ctx.planned_loader(), rec, optimizer=ctx.optimizer, name=name, weight_decay=ctx.weight_decay,
            optimizer_options=ctx.optimizer_options, precision=ctx.precision or ctx.cfg.precision, loss_fn=loss_fn,
            step_fn=ctx.step_fn, total_steps=total_steps, noise_scale=ctx.shared.found.get("noise_scale"),
            progress=ctx.cfg.progress)
    if batch_wanted:
        gate.done("batch_size", {"batch_size": rec.batch_size})


def choose_batch(model, loader, rec: Recipe, *, optimizer, name, weight_decay, optimizer_options, precision,
                 loss_fn, step_fn, total_steps, noise_scale, progress) -> None:
    """The batch part (T17, tune/batch_choice.py): the batch with the least predicted time to a target, the LR
    (and floor) scaled to it, the EMA refined for the run's length at it."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    b0 = getattr(loader, "batch_size", None)
    long_run = total_steps is not None and total_steps >= BATCH_MIN_STEPS  # else it decides without measuring
    scratch = candidate_optimizer(optimizer, model, lr=1e-6, name=name, weight_decay=weight_decay,
                                  options=optimizer_options) if long_run else optimizer
    new, dec = choose_run_batch(model, loader, total_steps=total_steps, noise_scale=noise_scale, optimizer=scratch,
                                precision=precision, loss_fn=loss_fn, step_fn=step_fn, world_size=world,
                                progress=progress, short="keep")
    rec.decisions["batch_size"] = dec
    if new is None or not b0:
        return
    rec.batch_size = new
    if "ema" in rec.parts and total_steps:  # the run is shorter in steps at the larger batch
        rec.decisions.refine("ema", choose_ema(rec, max(1, total_steps * b0 // new), f" at batch {new}"))
    kind = name or type(optimizer).__name__
    if rec.lr is not None:
        old = rec.lr
        rec.lr = scale_lr_for_batch(old, new, b0, kind)
        if rec.min_lr is not None:
            rec.min_lr = rec.min_lr * rec.lr / old
        prev = rec.decisions.get("lr")
        rule = "square root" if rec.lr / old != new / b0 else "linear"
        # the LR part's decision refined; without that part, the given LR scaled (then decided here)
        rec.decisions.refine("lr", Decision(rec.lr, f"{old:.3g} scaled to batch {new} by the {rule} rule for "
                                                    f"{kind} (T17)", measured=getattr(prev, "measured", None)))
