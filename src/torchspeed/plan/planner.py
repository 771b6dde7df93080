"""`make_plan`: every automatic choice of `fit`, as registered stages over one run context, resolved once, in
dependency order, its cost counted (T06-T08, T15, T17, T18, T21, T23, T25, T31-T33, T40, T42, T47).

The stages (`BUILT_IN`, registered in this order in `plan.stages.STAGES`; the one place to read the order;
Lightning Fabric's connector habit: resolve every "auto" once, then only read):

1. `distributed`: torchrun's process group first, so rank 0 measures for every rank;
2. `capabilities`: what this device runs natively (`env.DeviceCaps`); `backends`, `parallel` (DDP or FSDP2 under a
   process group) and `rules`: the backend switches, the parallel wrap and the rules' precision and layout;
3. `schedule`: the schedule rule (`train.schedule.default_schedule`) and the prior LR; a run given its own LR and
   no recipe keeps torch's own optimizer kernel (`fused_optimizer="default"`: the loop's numbers, bit for bit), and
   takes a layout or precision only 10% faster a step (`min_gain`);
4. `switches`: the switch trial first, on a copy, when a later stage measures (`plan.switches_first`);
5. the tuners, when asked (`plan.tuners`, measured by `tune.auto`): `tuners` checks their options, then
   `tune_batch` (`batch_size=`), `tune_lr` (`lr="auto"`, or a given LR scaled to a new batch) and `tune_loader`
   (`loader="auto"`, at the run's batch), their batch and settings recorded for the `loader` stage;
6. `run_length`: the run's steps, which the budget and the recipe read;
7. the recipe (`recipe="auto"`), one stage per part, within the tuning budget (`plan.budget`: at most 5% of the
   run's steps off the run, none on a cache hit): `recipe_setup` (the probe batches, the classifier check, the
   budget and the cache: `plan.recipe`), the free parts `label_smoothing`, `bn_stats`, `ema`, then `optimizer`
   (`plan.recipe_optimizer`), `lr` (`plan.recipe_lr`), `batch` (`plan.recipe_batch`), `tta_budget`
   (`plan.recipe_tta`), and `recipe`, which folds the parts into the run's config, optimizer, LR and callbacks;
8. `lr_world_size` (DDP, `scale_lr_world_size=True`: the LR x the world size, T17); `loader`, last: the loader
   rebuilt once, when a stage changed its batch size or settings;
9. at the run's start ("first_steps", with the Trainer): `optimizer_record`, the optimizer the Trainer built where
   no stage chose it; `switch_trial`, precision x layout x optimizer
   kernel (x threads) by the rules or a trial on the run's own first steps (`train.trial.autoswitch`; 0 steps on
   a cache hit), armed as the Trainer's `stepper` while it is live; `compile_trial`, `compile="auto"`'s trial told
   the run's length;
10. in the run, after the switch trial: `lr_in_run` (`plan.inrun`), the LR part at the precision the
   trial chose;
11. after training: `tta`, the flip-TTA check (`plan.recipe_tta`).

Every value in `Plan.decisions` is a `Decision`, each key written once, by the stage that declares it
(`Stage.writes`), and refined only by the stages that declare that (`Stage.refines`). The Trainer applies the plan
(`Decisions.planned`: it decides nothing itself, tests/plan/test_trainer_applies.py) and steps what its stages
arm; `fit` prints it before training (what was chosen, from what evidence, at what cost,
and what is still measured during the run).

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

from torchspeed.env import DeviceCaps, default_device
from torchspeed.plan.inrun import measure_lr_in_run
from torchspeed.plan.parts import Recipe
from torchspeed.plan.recipe import (bn_stats_part, ema_part, fold_recipe, label_smoothing_part, recipe_setup,
                                    wants)
from torchspeed.plan.recipe_batch import batch_part
from torchspeed.plan.recipe_lr import lr_part
from torchspeed.plan.recipe_optimizer import optimizer_part, wants_optimizer
from torchspeed.plan.recipe_tta import after_training, tta_part
from torchspeed.plan.stages import (RunContext, RunStages, Stage, first_steps_hook, register_stage, run_event,
                                    run_length, stages)
from torchspeed.plan.switches_first import switches_first, wants_switches_first
from torchspeed.plan.tuners import batch_tuner, loader_tuner, lr_tuner, tuners_setup, wants_tuners
from torchspeed.train.loop.callbacks import as_list
from torchspeed.train.trial.autoswitch import arm_switch_trial
from torchspeed.train.trial.backends import apply_backends, decide_backends
from torchspeed.train.trial.compile import arm_compile_trial
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decision, Decisions, TrialCache
from torchspeed.train.optim import optimizer_record
from torchspeed.train.parallel.fsdp import choose_parallel
from torchspeed.train.parallel.distributed import (maybe_init_distributed, scale_groups_world_size,
                                                   scale_lr_world_size, world_size_lr)
from torchspeed.train.optim_info import default_lr
from torchspeed.train.schedule import default_schedule, lr_given
from torchspeed.train.trial.switch_choice import AHEAD, rule_choice
from torchspeed.train.trial.user_state import UserState

__all__ = ["Plan", "make_plan", "BUILT_IN"]

PORTED_MIN_GAIN = AHEAD  # a run given its LR takes a layout or precision only 10% faster a step (its numbers move)
PORTED_TRIAL_SHARE = 0.02  # ... and its switch trial's first look costs at most 2% of its seconds (its later turns
# timed apart half that: shadow.ShadowTurns), so a trial that finds nothing leaves it within 3% of its own loop


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
    decisions: Decisions = field(default_factory=Decisions)
    tuning_s: float = 0.0
    tuning_steps: int = 0
    context: RunContext | None = field(default=None, repr=False)  # what the stages shared ("after" runs on it)
    first_steps: tuple = ()  # for the Trainer: runs the "first_steps" stages at the start of its run

    def summary(self) -> str:
        """The plan in words, one line per choice: value, then why."""
        lines = [f"torchspeed plan for a {self.run_steps or 'unknown'}-step run "
                 f"(choosing took {self.tuning_s:.1f} s and {self.tuning_steps} steps off the run):"]
        for k, d in self.decisions.items():
            lines.append(f"  {k}: {d.value!s:.60} - {d.reason}" if d.reason else f"  {k}: {d.value!s:.60}")
        return "\n".join(lines)


def make_plan(model: nn.Module, train_loader: Iterable, cfg: TrainConfig, *,
              optimizer: str | torch.optim.Optimizer = "sgd", lr: float | str | None = None,
              weight_decay: float | None = None, schedule_given: bool = True, optimizer_options: dict | None = None,
              loss_fn: Callable | None = None, step_fn: Callable | None = None,
              device: torch.device | str | None = None, batch_size: int | str | None = None, loader: str | None = None,
              recipe: str | None = None, recipe_parts: Sequence[str] | None = None, callbacks: Iterable | None = None,
              cache: TrialCache | None = None) -> Plan:
    """Resolve every automatic choice of a `fit` call: the "before" stages in order (see the module docstring);
    leaves the model as it was. `schedule_given=False`: `cfg.schedule` is a default, and
    `train.schedule.default_schedule` chooses it from how the LR was given (`lr=None`: torchspeed's default LR)."""
    if recipe not in (None, "auto"):
        raise ValueError(f"recipe={recipe!r}: use recipe='auto' (measured on your model) or leave it out")
    if recipe_parts is not None and recipe is None:
        raise ValueError("recipe_parts needs recipe='auto'")
    t0 = time.perf_counter()
    ctx = RunContext(model=model, loader=train_loader, cfg=cfg, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                     optimizer_options=optimizer_options, loss_fn=loss_fn, step_fn=step_fn, device=device,
                     batch_size=batch_size, loader_mode=loader, recipe=recipe, recipe_parts=recipe_parts,
                     schedule_given=schedule_given, cache=cache, callbacks=as_list(callbacks))
    state = UserState(model, step_fn).snapshot()  # the tuners and trials run the user's model and step_fn
    try:
        run_event(ctx, "before")
    finally:
        if ctx.shared is not None:  # a stage raised while the recipe held the RNG: put back (closed already, else)
            ctx.shared.rng.close()
        state.restore()  # what they left in its state (a step_fn's carried hidden state, a forward's attributes)
    ctx.decisions.planned = True  # the Trainer applies them and decides nothing (tests/plan/test_trainer_applies.py)
    if any(s.wanted(ctx) for s in stages("after_switches")):  # else no callback: nothing runs per step
        ctx.callbacks.append(RunStages(ctx))
    plan = Plan(loader=ctx.loader, optimizer=ctx.optimizer, lr=float(ctx.lr), config=ctx.cfg, callbacks=ctx.callbacks,
                run_steps=ctx.run_steps, recipe=ctx.rec, decisions=ctx.decisions,
                tuning_s=time.perf_counter() - t0, tuning_steps=ctx.tuning_steps, context=ctx,
                first_steps=(first_steps_hook(ctx),))
    ctx.decisions["tuning"] = Decision(
        round(plan.tuning_s, 3), f"{plan.tuning_steps} training steps off the run spent choosing before it (a "
        "switch trial on the run's own steps trains, and is not counted here)",
        measured={"seconds": plan.tuning_s, "steps_off_run": plan.tuning_steps, "run_steps": ctx.run_steps})
    return plan


# ---------------------------------------------------------------------------------------------- the stages
def _distributed(ctx: RunContext) -> None:
    ctx.dist = maybe_init_distributed(ctx.cfg.distributed, device=ctx.device)
    ctx.dev = ctx.dist.device if ctx.dist is not None else default_device(ctx.device)


def _capabilities(ctx: RunContext) -> None:
    ctx.caps = DeviceCaps.of(ctx.dev)
    ctx.decisions["device"] = Decision(str(ctx.dev), f"native half precision: {ctx.caps.half or 'none'}" + (
        f"; {ctx.dist.world_size} processes" if ctx.dist is not None else ""))
    ctx.decisions["switch_plan"] = Decision("on the run's first steps", "precision x layout x optimizer kernel (x "
                                            "threads) timed on real training steps that count toward the run; 0 "
                                            "steps on a cache hit")


def _backends(ctx: RunContext) -> None:
    """cudnn.benchmark and TF32 (CUDA), the intra-op threads and glibc malloc's settings (CPU), put into effect now:
    the tuners and trials after it measure under what the run trains with."""
    ctx.decisions.update(decide_backends(ctx.dev, ctx.cfg))
    apply_backends(ctx.dev, ctx.decisions)


def _parallel(ctx: RunContext) -> None:
    """DDP or FSDP2 under a process group (`parallel=`; "auto" shards a model whose state would fill half the
    device): the Trainer wraps the model as decided."""
    ctx.decisions["parallel"] = choose_parallel(ctx.cfg.parallel, ctx.model, ctx.dev, world_size=ctx.dist.world_size)


def _rules(ctx: RunContext) -> None:
    """The rules' precision and layout: what the run trains with until (or unless) its switch trial measures."""
    ctx.decisions.update(rule_choice(ctx.model, caps=ctx.caps, precision=ctx.cfg.precision,
                                     channels_last=ctx.cfg.channels_last)[1])


def _schedule(ctx: RunContext) -> None:
    """The schedule rule and the prior LR; and the kernel rule: a run given its own LR (a ported loop) and no recipe
    steps with torch's own kernel (`fused_optimizer="default"`), so its numbers are the loop's, bit for bit, and its
    switch trial takes a change of layout or precision only `PORTED_MIN_GAIN` faster a step (`min_gain`)."""
    ctx.own_lr = lr_given(ctx.lr, ctx.optimizer)
    if ctx.own_lr and not ctx.recipe:
        if ctx.cfg.fused_optimizer == "auto":
            ctx.cfg = replace(ctx.cfg, fused_optimizer="default")  # the decisions say why (optim_info.kernel_reason)
        if ctx.cfg.min_gain == TrainConfig.min_gain:  # a change that moves the loop's numbers must buy a 10% step
            ctx.cfg = replace(ctx.cfg, min_gain=PORTED_MIN_GAIN)
        if ctx.cfg.trial_share is None:  # where the trial finds nothing, the run stays within 3% of its own loop
            ctx.cfg = replace(ctx.cfg, trial_share=PORTED_TRIAL_SHARE)
    if not ctx.schedule_given:
        dec = ctx.decisions["schedule"] = default_schedule(lr=ctx.lr, optimizer=ctx.optimizer, recipe=ctx.recipe)
        ctx.cfg = replace(ctx.cfg, schedule=dec.value)
    # no LR given, or the recipe's LR part to decide (this is its prior where it cannot measure): the named
    # optimizer's own default LR (SGD 0.1, AdamW 1e-3)
    if ctx.lr is None or (ctx.recipe and ctx.lr == "auto"):
        ctx.lr = default_lr(ctx.optimizer)


def _run_length(ctx: RunContext) -> None:
    ctx.run_steps = run_length(ctx.planned_loader(), ctx.cfg)


def _loader(ctx: RunContext) -> None:
    """The loader rebuilt once, with every batch size and setting the stages chose (`RunContext.loader_changes`): the
    same object the stages after the tuners read (`RunContext.planned_loader`); the run's length at it."""
    ctx.loader = ctx.planned_loader()
    ctx.loader_changes = {}
    ctx.run_steps = run_length(ctx.loader, ctx.cfg)


def _lr_world_size(ctx: RunContext) -> None:
    """T17 under DDP with `scale_lr_world_size=True`: the run's LR x the world size (an optimizer given as an object:
    its groups' LR, in place), after every stage that measured at one process's LR."""
    n = ctx.dist.world_size
    if isinstance(ctx.optimizer, torch.optim.Optimizer):
        ctx.decisions.refine("lr", scale_groups_world_size(ctx.optimizer, n))
    else:
        ctx.lr = scale_lr_world_size(float(ctx.lr), world_size=n)
        ctx.decisions.refine("lr", world_size_lr(ctx.lr, n))


def _optimizer_record(ctx: RunContext) -> None:
    """The optimizer the Trainer built from the plan's choice, where no stage chose it: its class and kernel."""
    ctx.decisions["optimizer"] = optimizer_record(ctx.trainer.optimizer, ctx.trainer.config.fused_optimizer)


def _switch_trial(ctx: RunContext) -> None:
    arm_switch_trial(ctx.trainer, ctx.run_loader, ctx.steps_left, chosen=ctx.switches)


def _compile_trial(ctx: RunContext) -> None:
    arm_compile_trial(ctx.trainer, ctx.run_loader, ctx.steps_left)


def _tta_after(ctx: RunContext) -> None:
    """The recipe's after-training part: flip TTA when it scores better on training batches (T33)."""
    trainer, result = ctx.trainer, ctx.result
    asked = trainer.config.tta  # the user's own TTA stands, and the history already used it
    dec = after_training(trainer, ctx.rec)  # (in the trainer's decisions: the plan's "checked after training" refined)
    if dec.value and asked is None and ctx.val_loader is not None and result.history:
        result.history[-1]["val_acc_tta"] = trainer.evaluate(ctx.val_loader)["val_acc"]


# The built-in stages, in order: the one list a new stage joins (or `register_stage` from anywhere). Each declares the
# decision keys it decides (`writes`) and those it may refine (`refines`); tests/plan/test_declared.py holds them to it.
BUILT_IN = (
    Stage("distributed", "before", _distributed, cost="0 steps", fallback=False,
          what="torchrun's process group and this rank's device"),
    Stage("capabilities", "before", _capabilities, needs=("distributed",), fallback=False,
          what="what the device runs natively", writes=("device", "switch_plan")),
    Stage("backends", "before", _backends, needs=("capabilities",), fallback=False,
          what="cudnn.benchmark and TF32 (CUDA), threads and malloc (CPU), in effect from here",
          writes=("cudnn_benchmark", "tf32", "threads", "malloc")),
    Stage("parallel", "before", _parallel, needs=("capabilities",), fallback=False, cost="0 steps",
          what="DDP or FSDP2 under a process group", when=lambda ctx: ctx.dist is not None, writes=("parallel",)),
    Stage("rules", "before", _rules, needs=("capabilities",), fallback=False,
          what="the rules' precision and layout, until the switch trial measures", writes=("precision", "channels_last")),
    Stage("schedule", "before", _schedule, fallback=False, what="the schedule rule, the prior LR, and torch's own "
          "optimizer kernel for a run given its LR", writes=("schedule",)),
    Stage("switches", "before", switches_first, needs=("capabilities", "schedule"), cost="the trial's steps, off the "
          "run", what="precision x layout (x kernel) measured first when a later stage measures: it measures at "
          "what the run trains with", when=wants_switches_first, refines=("switch_plan",)),
    # the tuners, when asked: batch, then LR at that batch, then the loader's settings at it
    Stage("tuners", "before", tuners_setup, needs=("switches",), fallback=False, when=wants_tuners,
          what="the tuning options checked (`batch_size=`, `lr=\"auto\"`, `loader=`): a bad one is an error"),
    Stage("tune_batch", "before", batch_tuner, needs=("tuners",), cost="the batch timing's steps", fallback=False,
          what="`batch_size=\"auto\"`: the least predicted time to a target on a long run, else the fastest "
          "batch measured (the one batch chooser); or the batch given",
          when=lambda ctx: ctx.batch_size is not None, writes=("batch_size",)),
    Stage("tune_lr", "before", lr_tuner, needs=("tune_batch",), cost="the range test's steps", fallback=False,
          what="`lr=\"auto\"`: the peak LR measured at the run's batch; or the LR given, scaled to a new batch",
          when=lambda ctx: ctx.lr == "auto" or "batch_size" in ctx.loader_changes,
          writes=("lr_find", "lr", "peak_lr", "lr_scaled")),
    Stage("tune_loader", "before", loader_tuner, needs=("tune_lr",), cost="the loader tuner's timing",
          fallback=False, what="`loader=\"auto\"`: workers, pinning and prefetch measured at the run's batch",
          when=lambda ctx: ctx.loader_mode is not None, writes=("loader",)),
    Stage("run_length", "before", _run_length, needs=("tune_loader",), fallback=False, what="the run's steps"),
    # the recipe (`recipe="auto"`): one stage per part, each guarded (a part that fails keeps its prior)
    Stage("recipe_setup", "before", recipe_setup, needs=("run_length",), fallback=False,
          what="the recipe's parts, budget (5% of the run's steps), cache, probe batches and classifier check",
          when=lambda ctx: bool(ctx.recipe), writes=("recipe_prior",)),
    Stage("label_smoothing", "before", label_smoothing_part, needs=("recipe_setup",), fallback=False,
          what="0.1 for a classifier on the default cross-entropy", when=wants("label_smoothing"),
          writes=("label_smoothing",)),
    Stage("bn_stats", "before", bn_stats_part, needs=("recipe_setup",), fallback=False,
          what="BatchNorm statistics averaged over the run's last tenth", when=wants("bn_stats"),
          writes=("bn_stats",)),
    Stage("ema", "before", ema_part, needs=("recipe_setup",), fallback=False,
          what="an EMA of the weights on runs of 2,000+ steps", when=wants("ema"), writes=("ema",)),
    Stage("optimizer", "before", optimizer_part, needs=("recipe_setup",), cost="50 steps a candidate, off the run",
          fallback=False, what="Muon or Schedule-Free AdamW against the optimizer given by name",
          when=wants_optimizer, writes=("optimizer",), refines=("label_smoothing", "bn_stats", "ema", "schedule")),
    Stage("lr", "before", lr_part, needs=("optimizer",), cost="~172 steps, off the run", fallback=False,
          what="the peak LR and floor: pending for `lr_in_run`, measured, cached, the prior; or Schedule-Free's",
          when=wants("lr"), writes=("lr",)),
    Stage("batch", "before", batch_part, needs=("lr",), cost="~150 steps and a 0.9 s floor, off the run",
          fallback=False, what="the batch with the least predicted time to a target; the LR scaled to it",
          when=wants("batch"), writes=("batch_size",), refines=("lr", "ema")),
    Stage("tta_budget", "before", tta_part, needs=("recipe_setup",), cost="~3 steps (the check after training)",
          fallback=False,
          what="whether the flip-TTA check after training fits the budget (else cached, or no TTA)",
          when=wants("tta"), writes=("tta",)),
    Stage("recipe", "before", fold_recipe, needs=("recipe_setup",), fallback=False,
          what="the parts folded into the run's config, optimizer, LR and callbacks; the recipe's cost",
          when=lambda ctx: ctx.rec is not None, writes=("recipe_cost",), refines=("schedule",)),
    Stage("lr_world_size", "before", _lr_world_size, needs=("run_length",), fallback=False,
          what="the LR x the world size (T17), after every stage that measured at one process's LR",
          when=lambda ctx: ctx.cfg.scale_lr_world_size and ctx.dist is not None, refines=("lr",)),
    Stage("loader", "before", _loader, fallback=False, last=True,
          what="the loader rebuilt once, when a stage changed its batch size or settings",
          when=lambda ctx: bool(ctx.loader_changes)),
    Stage("optimizer_record", "first_steps", _optimizer_record, fallback=False, cost="0 steps",
          what="the optimizer the Trainer built, where no stage chose it: its class and kernel",
          when=lambda ctx: "optimizer" not in ctx.decisions, writes=("optimizer",)),
    Stage("switch_trial", "first_steps", _switch_trial, needs=("optimizer_record",), fallback=False,
          cost="the run's own first steps (0 on a "
          "cache hit)", what="precision x layout x optimizer kernel (x threads): the rules, or a trial the Trainer "
          "steps on the run's first steps", writes=("switch_trial", "fused_optimizer"),
          refines=("precision", "channels_last", "threads", "optimizer")),
    Stage("compile_trial", "first_steps", _compile_trial, needs=("switch_trial",), fallback=False,
          cost="the run's own steps", what="`compile=\"auto\"`: told the run's length (a short run stays eager)"),
    Stage("lr_in_run", "after_switches", measure_lr_in_run, cost="the range test's steps, off the run",
          what="the LR part at the precision the switch trial chose",
          when=lambda ctx: ctx.rec is not None and "lr" in ctx.rec.pending, refines=("lr",)),
    Stage("tta", "after", _tta_after, cost="~8 forward passes", what="flip TTA, kept where it scores better",
          when=lambda ctx: ctx.rec is not None and "tta" in ctx.rec.parts, refines=("tta",)),
)
for _stage in BUILT_IN:
    register_stage(_stage, replace=True)
