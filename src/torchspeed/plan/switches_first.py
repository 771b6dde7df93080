"""The switch trial before the plan's trials: the optimizer trial, the batch timing and the tuners measure at the
precision and layout the run will train with (T18, T21, T23).

The switch trial (`train.trial.autoswitch`) runs on the run's own first steps, so it costs no steps off
the run. But a stage that measures before training (the tuners, the recipe's optimizer trial and
batch part) would then measure at the rule's precision, which the trial may overturn: bf16 is
the rule on a CPU that runs it natively, and on a small model fp32 can be faster there.

So when a "before" stage will measure (the tuners were asked for, or the recipe's budget affords
a measured part), the `switches` stage runs the trial first, on a copy of the model and
optimizer and the plan's probe batches (steps off the run, counted in `tuning`), with every RNG
and the loader's order put back. The later stages measure at its precision (`RunContext.precision`),
and the trial's result reaches the run in the context (`RunContext.switches`): the run's "switch_trial" stage
puts it into effect (0 steps), whatever the recipe changed after it (the batch, the optimizer), so a run measures
one trial. It goes to the trial cache too, for later runs. Where nothing before training measures,
the trial stays on the run's first steps, as before.

Example:
    >>> fit(model, loader, epochs=100, recipe="auto")   # long run: decisions["switch_plan"] says
    ...                                                  # "measured before the plan's trials"
"""

from __future__ import annotations

import copy
from dataclasses import replace

from torchspeed.plan import budget as budget_rules
from torchspeed.plan.budget import TuningBudget
from torchspeed.plan.recipe_batch import BATCH_COST
from torchspeed.plan.recipe_optimizer import OPTIMIZER_TRIAL_STEPS
from torchspeed.plan.stages import RunContext, run_length
from torchspeed.plan.tuners import wants_tuners
from torchspeed.train.decision import Decision
from torchspeed.train.optim_info import default_lr
from torchspeed.train.trial.precision import normalize_precision
from torchspeed.train.sampler import keep_rng, take_batches
from torchspeed.train.loop.trainer import Trainer
from torchspeed.train.transfer import to_device

__all__ = ["wants_switches_first", "switches_first", "PROBE_BATCHES", "MAX_PROBE_STEPS"]

PROBE_BATCHES = 4
MAX_PROBE_STEPS = 200  # a trial that has not decided by then decides on what it measured
CHEAPEST_PART = min(BATCH_COST, 2 * OPTIMIZER_TRIAL_STEPS)  # the recipe measures nothing its budget cannot afford
PROBE_COST = 40  # about what the trial takes (4 candidates x 3 rounds x 2 steps, warm-ups, the kernel stage)


def wants_switches_first(ctx: RunContext) -> bool:
    """Whether a "before" stage will measure while the switch trial still has a precision or layout to choose."""
    cfg = ctx.cfg
    if cfg.trial is False or cfg.deterministic or ctx.dist is not None:  # (under DDP the run's trial broadcasts)
        return False
    if normalize_precision(cfg.precision) != "auto" and cfg.channels_last != "auto":
        return False
    if wants_tuners(ctx):
        return True  # the tuners measure
    if not ctx.recipe:
        return False
    budget = TuningBudget(run_length(ctx.loader, cfg), share=budget_rules.TUNING_SHARE)
    return budget.allows(PROBE_COST + CHEAPEST_PART)  # its steps count in the recipe's budget


def switches_first(ctx: RunContext) -> None:
    """Run the switch trial on copies and the probe batches; its precision is the context's from here on."""
    opts = ctx.optimizer_options or {}
    lr = ctx.lr if isinstance(ctx.lr, (int, float)) else default_lr(ctx.optimizer)
    cfg = replace(ctx.cfg, progress=False, compile=False, checkpoint_dir=None, resume=None, out_dir=None,
                  malloc=False, max_steps=None)
    with keep_rng(ctx.loader):  # the run sees the same batches and RNG as without this stage
        batches = [to_device(b, ctx.dev) for b in take_batches(ctx.loader, PROBE_BATCHES)]
        model, optimizer = copy.deepcopy((ctx.model, ctx.optimizer))  # an optimizer object follows its copy
        trainer = Trainer(model, loss_fn=ctx.loss_fn, step_fn=ctx.step_fn, optimizer=optimizer, lr=float(lr),
                          weight_decay=ctx.weight_decay, momentum=opts.get("momentum", 0.9),
                          betas=opts.get("betas", (0.9, 0.999)), device=ctx.dev, config=cfg, caps=ctx.caps)
        trainer.switcher.keep_numerics = False  # a copy: its candidates train their own steps, none timed apart
        trainer.switcher.prepare(ctx.loader, remaining_steps=run_length(ctx.loader, ctx.cfg))  # the run's own trial key
        steps = 0
        while trainer.switcher.live is not None and steps < MAX_PROBE_STEPS:
            trainer.step_batch(batches[steps % len(batches)])
            steps += 1
        trainer.switcher.finish()
    ctx.precision = trainer.precision.name
    how = trainer.decisions["switch_trial"]
    ctx.switches = (trainer.switcher.current(), dict(how.measured or {}))  # the run's: one trial per run
    steps = int((how.measured or {}).get("steps", steps))  # a cache hit: 0 (its one step was the cache check)
    ctx.tuning_steps += steps
    ctx.decisions.refine("switch_plan", Decision(
        f"before the plan's trials: {trainer.precision.name}" + (", channels_last" if trainer.channels_last else ""),
        f"{how.value}: {steps} steps on a copy of the model, off the run, so that the trials after it measure at "
        "the precision the run trains with; the run takes the result (one trial per run)",
        measured={"steps": steps, "precision": trainer.precision.name, "channels_last": trainer.channels_last}))
