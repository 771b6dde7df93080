"""A training recipe chosen by measuring the user's own model and training data: fewer steps to the same accuracy.

The speed switches (precision, channels_last, fused kernels, compile) make each step cheaper;
the recipe makes fewer steps do. Under `fit(..., recipe="auto")` (`plan.make_plan`) every part is a stage of
the plan (`plan.planner.BUILT_IN`, in this order): `recipe_setup` (this module: the parts asked for, the tuning
budget and the cache, the held probe batches, the classifier check and the `Gate`, shared in `ctx.shared`), the
free parts `label_smoothing`, `bn_stats` and `ema` (this module), `optimizer` (`plan/recipe_optimizer.py`), `lr`
(`plan/recipe_lr.py`), `batch` (`plan/recipe_batch.py`), `tta_budget` (`plan/recipe_tta.py`), then `recipe` (this
module), which folds what the parts chose into the run's config, optimizer, LR and callbacks. Each part writes
its Decisions into the plan's, with its reason; every part is also a plain function or object for your own loop.
Nothing here reads a validation set: the choices are made on training batches alone (a test replaces the
validation set and checks they do not change).

The parts (`PARTS`), and how each is chosen:

- `lr` (T14, T15; `plan/recipe_lr.py`): the one-cycle peak LR and floor from the LR range test (`find_lr`), run
  with the optimizer and precision the run trains with. When its curve is flat or noisy the
  range test says so and falls back to a short measured trial of a few LRs.
- `label_smoothing` (T32): 0.1 for per-sample classification with the default cross-entropy
  (a model that returns its own loss, your own `loss_fn`, and per-token outputs such as a
  language model's are left alone).
- `bn_stats` (T47): BatchNorm statistics averaged over the last tenth of the run
  (`train.bnstats.FinalBatchNormStats`), so evaluation uses statistics of the final weights.
  The largest single saving measured on the digits (docs/recipe.md). Costs nothing.
- `ema` (T40): an EMA of the weights (`train.loop.callbacks.EMA`, on `torch.optim.swa_utils`) for
  runs long enough for the average to span a small part of them (>= `EMA_MIN_STEPS` steps;
  decay so that it spans about a twentieth of the run). Shorter runs: off; on the digits at
  48 steps it gained nothing (docs/recipe.md).
- `tta` (T33; `plan/recipe_tta.py`): flip test-time augmentation, decided *after* training by `choose_tta` on a
  few training batches: kept only when it scores better there (the digits are not
  flip-invariant: it is refused there). The check (8 forward passes, ~`TTA_COST` steps) is
  charged to the budget: a shorter run reads the cache or keeps the prior, no TTA.
- `muon` (T42) and `schedulefree` (T14's alternative), in `plan/recipe_optimizer.py`: candidates
  against the optimizer the run was given by name. Muon (for the hidden matrices) is one for
  AdamW on a model whose weights are mostly hidden 2D matrices; Schedule-Free AdamW (the
  `schedulefree` extra) for SGD or AdamW. When the budget affords a short trial
  (`tune.optimizer_trial`, 50 steps a candidate) they are compared on time to the given
  optimizer's training loss; else an earlier run's measurement; else the prior by run length and model
  kind (`plan/recipe_horizon.py`, measured): Schedule-Free AdamW at an LR set by the model's width, which
  needs no LR search and no schedule, or AdamW with warmup-stable-decay for a language model. Schedule-Free
  chosen replaces the LR part, the floor, the BatchNorm tail (it recalibrates statistics for its averaged
  weights) and the EMA. An optimizer object, or LAMB/LARS/Muon by name, is kept as given.
- `batch` (T17): for runs of at least `BATCH_MIN_STEPS` steps, the batch with the least
  predicted time to a target (`plan/recipe_batch.py`): samples needed grow as 1 + B/B_noise (the gradient
  noise scale, measured at the end of the LR trial), divided by the samples/s measured at half to four
  times the loader's batch (`tune.batch_choice`). The LR follows (linear rule for SGD, square
  root for Adam-family). The plan's last "before" stage, `loader`, rebuilds the DataLoader; a batch size given
  to `fit` switches the part off. Its cost is priced in the run's steps from a timed forward and backward pass
  (`batch_cost`): its timing runs at up to 4x the batch, with a floor of seconds a step count
  does not show.

Cost: the range test's steps (100 by default) and, when asked, the fallback and optimizer
trials; `Recipe.tuning_s` and `Recipe.tuning_steps` report it, and the bench counts it
("tuning included").

Example:
    >>> recipe = make_plan(model, loader, TrainConfig(epochs=5), recipe="auto").recipe
    >>> fit(model, loader, lr=recipe.lr, min_lr=recipe.min_lr, label_smoothing=recipe.label_smoothing,
    ...     callbacks=recipe.callbacks())
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from torchspeed.plan import budget as budget_rules  # its TUNING_SHARE read at each plan (tests inject it)
from torchspeed.plan.budget import TuningBudget
from torchspeed.plan.parts import PARTS, Gate, Recipe, Shared, choose_ema, recipe_key
from torchspeed.plan.stages import RunContext
from torchspeed.train.trial.backends import no_autotune
from torchspeed.train.loop.batch import first_samples, forward_loss
from torchspeed.train.bnstats import batchnorm_layers
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.optim_info import OPTIM_INFO
from torchspeed.train.sampler import keep_rng, take_batches
from torchspeed.train.transfer import to_device
from torchspeed.train.trial.trial_safety import kept_buffers

__all__ = ["LABEL_SMOOTHING", "PROBE_BATCHES", "GIVEN_LOOP_KEEPS", "is_classifier", "recipe_setup",
           "label_smoothing_part", "bn_stats_part", "ema_part", "fold_recipe", "wants"]

LABEL_SMOOTHING = 0.1
PROBE_BATCHES = 4
GIVEN_LOOP_KEEPS = ("lr", "label_smoothing")  # recipe parts left out when the run gives its own LR (docs/recipe.md)


def is_classifier(model: nn.Module, batch, *, loss_fn: Callable | None = None,
                  step_fn: Callable | None = None) -> bool:
    """Whether `model` on `batch` is per-sample classification on the default cross-entropy: logits (B, C), C > 2.
    Read from a forward pass on the batch's first 2 samples: the shapes are the same, at a fraction of the cost."""
    if loss_fn is not None or step_fn is not None:
        return False
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), no_autotune(), kept_buffers(model):  # 2 samples: a shape the run never trains at
            out = forward_loss(model, first_samples(batch, 2))
    except Exception:  # a batch this check cannot read: leave classification parts off
        return False
    finally:
        model.train(was)
    if getattr(out, "own_loss", False) or out.logits is None or out.target is None:
        return False  # the model computes its own loss: not ours to smooth
    if out.logits.dim() != 2:
        return False  # per-token (language models) or per-pixel outputs: smoothing is not part of their recipe
    return out.correct() is not None and out.logits.shape[-1] > 2


def wants(part: str) -> Callable[[RunContext], bool]:
    """A part-stage's `when`: the recipe is on and has `part`."""
    return lambda ctx: ctx.rec is not None and part in ctx.rec.parts


def _parts(ctx: RunContext) -> tuple[str, ...]:
    """The parts this run's recipe runs: those asked for, less the batch part when fit was given a batch size, and
    less the LR search and label smoothing when the run gave its own LR (said in decisions["recipe_prior"])."""
    parts = tuple(ctx.recipe_parts if ctx.recipe_parts is not None else PARTS)
    if ctx.batch_size is not None:  # the user's batch (or the tuner's) stands
        parts = tuple(p for p in parts if p != "batch")
    if ctx.own_lr and ctx.recipe_parts is None:  # your loop is the prior: what changes its objective or LR unmeasured
        parts = tuple(p for p in parts if p not in GIVEN_LOOP_KEEPS)
        ctx.decisions["recipe_prior"] = Decision(
            "your loop", "you gave the LR: your optimizer, LR, schedule and loss stand; the LR search and label "
            "smoothing are left out, and Schedule-Free or Muon replace your optimizer only when their trial wins "
            "(recipe_parts= puts parts back)")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown recipe part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    return parts


def recipe_setup(ctx: RunContext) -> None:
    """The "recipe_setup" stage: what the parts share. The parts, the budget (at most `TUNING_SHARE` of the run's
    steps off the run, less what the stages before spent), the cache (none under DDP: a cache file could differ
    per machine, and every rank runs the same parts, measured on rank 0), the probe batches, the classifier check
    and the `Gate`; every RNG and the loader's order held until the `recipe` stage, so the run sees the same data."""
    parts = _parts(ctx)
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    ctx.cache = None if several else (ctx.cache if ctx.cache is not None else TrialCache())
    budget = TuningBudget(ctx.run_steps, share=budget_rules.TUNING_SHARE)
    budget.spend(ctx.tuning_steps)  # what the stages before it spent off the run (the switch trial) counts too
    started = time.perf_counter()
    ctx.model.to(ctx.dev)
    loader = ctx.planned_loader()
    held = take_batches(loader, PROBE_BATCHES)
    lr = float(ctx.lr)
    rec = Recipe(lr=lr, parts=parts, probe=held, decisions=ctx.decisions)  # the parts decide into the plan's
    classifier = is_classifier(ctx.model, to_device(held[0], ctx.dev), loss_fn=ctx.loss_fn, step_fn=ctx.step_fn)
    given = ctx.optimizer if isinstance(ctx.optimizer, str) else type(ctx.optimizer).__name__
    gate = Gate(rec, budget, ctx.cache, recipe_key(ctx.model, held[0], given, lr, ctx.cfg.schedule,
                                                   ctx.cfg.precision or ctx.precision, parts))
    ctx.rec, ctx.shared = rec, Shared(gate, classifier, started)
    ctx.shared.rng.enter_context(keep_rng(loader))  # the parts read the loader: the run's data order stays as it was


def label_smoothing_part(ctx: RunContext) -> None:
    """The "label_smoothing" part (T32), free: 0.1 for a classifier on the default cross-entropy."""
    if ctx.shared.classifier:
        ctx.rec.label_smoothing = LABEL_SMOOTHING
        ctx.decisions["label_smoothing"] = Decision(LABEL_SMOOTHING, "classification with the default cross-entropy "
                                                                     "(T32)")
    else:
        ctx.decisions["label_smoothing"] = Decision(0.0, "not a classifier on the default cross-entropy: left alone")


def bn_stats_part(ctx: RunContext) -> None:
    """The "bn_stats" part (T47), free: BatchNorm statistics averaged over the run's last tenth."""
    n_bn = len(batchnorm_layers(ctx.model))
    ctx.rec.bn_stats = n_bn > 0
    ctx.decisions["bn_stats"] = Decision(ctx.rec.bn_stats, f"{n_bn} BatchNorm layers: statistics averaged over the "
                                                           "run's last tenth (T47)" if n_bn else "no BatchNorm layer")


def ema_part(ctx: RunContext) -> None:
    """The "ema" part (T40), free: by the run's length (the batch part refines it for the run at its batch)."""
    ctx.decisions["ema"] = choose_ema(ctx.rec, ctx.run_steps)


def fold_recipe(ctx: RunContext) -> None:
    """The "recipe" stage: the RNG put back, the measurements cached, the recipe's cost said, and what the parts
    chose folded into the run's config, optimizer, LR and callbacks (a new batch: the "loader" stage rebuilds)."""
    rec, shared = ctx.rec, ctx.shared
    shared.rng.close()
    shared.gate.save()
    rec.tuning_s = time.perf_counter() - shared.started
    budget = shared.gate.budget
    ctx.decisions["recipe_cost"] = Decision(
        round(rec.tuning_s, 2), f"{rec.tuning_steps} training steps spent choosing off the run" + (
            f" (budget {budget.limit} steps, {budget.share:.0%} of the run)" if budget else ""),
        measured={"seconds": rec.tuning_s, "steps": rec.tuning_steps})
    changes = rec.config()
    if ctx.cfg.min_lr is not None:  # the user's own floor wins
        changes.pop("min_lr", None)
    if ctx.loss_fn is not None:
        changes.pop("label_smoothing", None)
    ctx.cfg = replace(ctx.cfg, **changes)
    if rec.optimizer and isinstance(ctx.optimizer, str):
        ctx.optimizer = rec.optimizer
        if getattr(OPTIM_INFO.get(str(rec.optimizer).lower()), "schedule_free", False) and \
                "schedule" in ctx.decisions:  # the plan says what the run does
            ctx.decisions.refine("schedule", Decision(None, "Schedule-Free AdamW: no LR schedule (its averaging "
                                                            "takes the schedule's place; the run sets its warm-up)"))
    if rec.batch_size and rec.batch_size != getattr(ctx.planned_loader(), "batch_size", None):
        ctx.loader_changes = ctx.loader_changes | {"batch_size": rec.batch_size}
    if rec.lr is not None:
        ctx.lr = rec.lr
    ctx.callbacks += rec.callbacks()
    ctx.tuning_steps += rec.tuning_steps
