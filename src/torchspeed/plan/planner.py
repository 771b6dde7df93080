"""`make_plan`: every automatic choice of `fit`, resolved once, in dependency order, its cost counted (T06-T08, T15,
T17, T18, T21, T23, T25, T31-T33, T40, T42, T47).

The order (Lightning Fabric's connector habit: resolve every "auto" once, then only read):

1. distributed set-up (torchrun's process group first, so rank 0 measures for every rank);
2. device capabilities (`env.DeviceCaps`: what this device runs natively);
3. switches (precision, channels_last, optimizer kernel, threads): measured on the run's own
   first steps by the Trainer (`train.autoswitch`), 0 steps on a cache hit; the plan states it;
4. batch size and 5. LR, when asked (`batch_size=`, `lr="auto"`: `tune.auto.tune_for_fit`);
6. the recipe parts (`recipe="auto"`: `plan.recipe.choose_recipe`) within the tuning budget
   (`plan.budget`: at most 5% of the run's steps off the run, none on a cache hit);
7. the loader, rebuilt at most once, for the batch and worker settings chosen above.

Every value in `Plan.decisions` is a `Decision`. The Trainer only applies the plan; `fit` prints
it before training (what was chosen, from what evidence, at what cost, and what is still measured
during the run).

Example:
    >>> plan = make_plan(model, loader, TrainConfig(epochs=3), recipe="auto")
    >>> print(plan.summary())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from torchspeed.plan.budget import TuningBudget
from torchspeed.plan.recipe import PARTS, Recipe, choose_recipe
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.schedule import DEFAULT_LR, default_schedule, lr_given

__all__ = ["Plan", "make_plan", "as_decisions"]

DEFAULT_RECIPE_LR = 0.1  # the prior peak LR when the recipe is asked to choose it and cannot afford to measure
GIVEN_LOOP_KEEPS = ("lr", "label_smoothing")  # recipe parts left out when the run gives its own LR (docs/recipe.md)


def as_decisions(decisions: dict) -> dict[str, Decision]:
    """Each value a `Decision` (a plain value becomes `Decision(value, "")`)."""
    return {k: v if isinstance(v, Decision) else Decision(v, "") for k, v in decisions.items()}


@dataclass
class Plan:
    """What the planner resolved: the loader, optimizer, LR, config and callbacks the Trainer applies."""

    loader: Iterable
    optimizer: str | torch.optim.Optimizer
    lr: float
    config: TrainConfig
    callbacks: list
    run_steps: int | None
    recipe: Recipe | None = None
    decisions: dict[str, Decision] = field(default_factory=dict)
    tuning_s: float = 0.0
    tuning_steps: int = 0

    def summary(self) -> str:
        """The plan in words, one line per choice: value, then why."""
        lines = [f"torchspeed plan for a {self.run_steps or 'unknown'}-step run "
                 f"(choosing took {self.tuning_s:.1f} s and {self.tuning_steps} steps off the run):"]
        for k, d in self.decisions.items():
            lines.append(f"  {k}: {d.value!s:.60} - {d.reason}" if d.reason else f"  {k}: {d.value!s:.60}")
        return "\n".join(lines)


def _run_steps(loader: Iterable, cfg: TrainConfig) -> int | None:
    from torchspeed.train.sampler import loader_length
    from torchspeed.train.schedule import steps_in_run

    return steps_in_run(loader_length(loader, max_steps=cfg.max_steps), cfg.epochs, grad_accum=cfg.grad_accum,
                        max_steps=cfg.max_steps)


def make_plan(model: nn.Module, train_loader: Iterable, cfg: TrainConfig, *,
              optimizer: str | torch.optim.Optimizer = "sgd", lr: float | str | None = None,
              weight_decay: float | None = None, schedule_given: bool = True, optimizer_options: dict | None = None,
              loss_fn: Callable | None = None, step_fn: Callable | None = None,
              device: torch.device | str | None = None, batch_size: int | str | None = None, loader: str | None = None,
              recipe: str | None = None, recipe_parts: Sequence[str] | None = None, callbacks: Iterable | None = None,
              cache: TrialCache | None = None) -> Plan:
    """Resolve every automatic choice of a `fit` call (see the module docstring); leaves the model as it was.
    `schedule_given=False`: `cfg.schedule` is a default, and `train.schedule.default_schedule` chooses it from
    how the LR was given (`lr=None`: torchspeed's default LR)."""
    from torchspeed.env import DeviceCaps, default_device
    from torchspeed.train.distributed import maybe_init_distributed

    if recipe not in (None, "auto"):
        raise ValueError(f"recipe={recipe!r}: use recipe='auto' (measured on your model) or leave it out")
    if recipe_parts is not None and recipe is None:
        raise ValueError("recipe_parts needs recipe='auto'")
    t0 = time.perf_counter()
    d: dict[str, Decision] = {}
    info = maybe_init_distributed(cfg.distributed, device=device)  # 1: so that rank 0 measures for every rank
    dev = info.device if info is not None else default_device(device)
    caps = DeviceCaps.of(dev)  # 2
    d["device"] = Decision(str(dev), f"native half precision: {caps.half or 'none'}"
                           + (f"; {info.world_size} processes" if info is not None else ""))
    d["switch_plan"] = Decision("on the run's first steps", "precision x layout x optimizer kernel (x threads) "
                                "timed on real training steps that count toward the run; 0 steps on a cache hit")
    own_lr = lr_given(lr, optimizer)
    if not schedule_given:
        d["schedule"] = default_schedule(lr=lr, optimizer=optimizer, recipe=recipe)
        cfg = replace(cfg, schedule=d["schedule"].value)
    if lr is None:
        lr = DEFAULT_LR
    if recipe and lr == "auto":  # the recipe's LR part decides; this is its prior when it cannot afford to measure
        lr = DEFAULT_RECIPE_LR
    tuned: dict = {}
    if batch_size is not None or lr == "auto" or loader is not None:  # 4, 5 (and the loader's settings, 7)
        from torchspeed.tune.auto import tune_for_fit

        train_loader, lr, tuned = tune_for_fit(model, train_loader, batch_size=batch_size, lr=lr, loader=loader,
                                               loss_fn=loss_fn, step_fn=step_fn, optimizer=optimizer,
                                               weight_decay=weight_decay, optimizer_options=optimizer_options,
                                               device=dev, precision=cfg.precision, schedule=cfg.schedule,
                                               distributed=cfg.distributed, progress=cfg.progress)
    d.update(as_decisions(tuned))
    run_steps = _run_steps(train_loader, cfg)
    plan = Plan(loader=train_loader, optimizer=optimizer, lr=float(lr), config=cfg, callbacks=list(callbacks or ()),
                run_steps=run_steps, decisions=d)
    if recipe:  # 6
        parts = tuple(recipe_parts if recipe_parts is not None else PARTS)
        if batch_size is not None:  # the user's batch (or the tuner's, above) stands
            parts = tuple(p for p in parts if p != "batch")
        if own_lr and recipe_parts is None:  # your loop is the prior: what changes its objective or LR unmeasured
            parts = tuple(p for p in parts if p not in GIVEN_LOOP_KEEPS)
            d["recipe_prior"] = Decision("your loop", "you gave the LR: your optimizer, LR, schedule and loss stand; "
                                         "the LR search and label smoothing are left out, and Schedule-Free or Muon "
                                         "replace your optimizer only when their trial wins (recipe_parts= puts "
                                         "parts back)")
        _apply_recipe(plan, model, parts, weight_decay=weight_decay, optimizer_options=optimizer_options,
                      loss_fn=loss_fn, step_fn=step_fn, device=dev, cache=cache, lr_given=own_lr)
    plan.tuning_s = time.perf_counter() - t0
    d["tuning"] = Decision(round(plan.tuning_s, 3), f"{plan.tuning_steps} training steps off the run spent choosing "
                           "before it (the switch trial's steps train and are not counted here)",
                           measured={"seconds": plan.tuning_s, "steps_off_run": plan.tuning_steps,
                                     "run_steps": run_steps})
    return plan


def _apply_recipe(plan: Plan, model, parts, *, weight_decay, optimizer_options, loss_fn, step_fn, device,
                  cache, lr_given: bool = False) -> None:
    """The recipe (plan/recipe.py) within the tuning budget, folded into the config, optimizer, LR, callbacks, loader."""
    import torch.distributed as dist

    from torchspeed.plan import budget as budget_rules

    cfg = plan.config
    budget = TuningBudget(plan.run_steps, share=budget_rules.TUNING_SHARE)
    # Every rank runs the same parts (their trials measure on rank 0 and broadcast); a cache file could differ per
    # machine, so under DDP the recipe is measured afresh rather than read from it.
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rec = choose_recipe(model, plan.loader, optimizer=plan.optimizer, lr=plan.lr, weight_decay=weight_decay,
                        optimizer_options=optimizer_options, precision=cfg.precision, loss_fn=loss_fn,
                        step_fn=step_fn, total_steps=plan.run_steps, schedule=cfg.schedule, parts=parts,
                        device=device, progress=cfg.progress, budget=budget,
                        cache=None if several else (cache if cache is not None else TrialCache()),
                        lr_in_run=cfg.trial is not False and not cfg.deterministic, lr_given=lr_given)
    changes = rec.config()
    if cfg.min_lr is not None:  # the user's own floor wins
        changes.pop("min_lr", None)
    if loss_fn is not None:
        changes.pop("label_smoothing", None)
    plan.config = replace(cfg, **changes)
    if rec.optimizer and isinstance(plan.optimizer, str):
        plan.optimizer = rec.optimizer
    if rec.batch_size and rec.batch_size != getattr(plan.loader, "batch_size", None):
        from torchspeed.train.sampler import rebuild_loader

        plan.loader = rebuild_loader(plan.loader, batch_size=rec.batch_size)
        plan.run_steps = _run_steps(plan.loader, plan.config)
    if rec.lr is not None:
        plan.lr = rec.lr
    plan.callbacks += rec.callbacks()
    if "lr" in rec.pending:  # measured in the run, after the switch trial, at the precision it chooses
        from torchspeed.plan.inrun import MeasureInRun

        plan.callbacks.append(MeasureInRun(
            rec, plan.loader, optimizer=plan.optimizer, schedule=cfg.schedule, loss_fn=loss_fn, step_fn=step_fn,
            weight_decay=weight_decay, optimizer_options=optimizer_options,
            cache=None if several else (cache if cache is not None else TrialCache()), progress=cfg.progress))
    plan.recipe = rec
    plan.tuning_steps += rec.tuning_steps
    plan.decisions.update(as_decisions(rec.decisions))
