"""The plan's stages: every automatic choice of `fit` is one registered `Stage` over one `RunContext` (T06-T08, T15,
T17, T18, T21, T23, T25, T31-T33, T40, T42, T47).

A stage has a name, the event it runs at, what must run before it, its cost in words, and a function
of the `RunContext` that reads what earlier stages resolved and writes its `Decision`s into
`ctx.decisions` (each key once: `train.decision.Decisions`). The events:

- "before": before training, in `plan.make_plan` (distributed set-up, capabilities, the schedule
  rule, the tuners, the recipe);
- "first_steps": at the start of the Trainer's run, with the trainer, the loader it trains on and the
  steps left (`ctx.trainer`, `ctx.run_loader`, `ctx.steps_left`): a stage arms what the Trainer steps on
  the run's first steps (the switch trial arms the Trainer's `stepper`, which its `step_batch` calls in place of
  the plain step until the trial disarms it; the compile trial); the plan hands the Trainer
  `first_steps_hook(ctx)`, which runs these stages;
- "after_switches": inside the run, at the first step end once the switch trial has settled, so a
  stage measures at the precision, layout and kernels the run trains with (`RunStages`, a callback
  the plan adds only when such a stage is wanted);
- "after": once training ends (`fit` calls `run_event(ctx, "after")`), e.g. the flip-TTA check.

`register_stage(Stage(...))` adds a stage with no other edit: `stages(event)` lists the registered
stages of an event in registration order, each after the stages it `needs` (a stage marked `last`, the
loader's rebuild, after every other one). The built-in stages are registered in one visible list
(`plan.planner.BUILT_IN`); docs/architecture.md renders the order (`render_stages`). A stage with
`fallback=True` that raises is reported with its name (a warning and its Decision) and the run goes on
with what the context held before it: a stage that fails never ends a run. Stages that check the
user's input (`fallback=False`) raise, so a bad argument is an error.

A stage declares the decision keys it `writes` (decides; one stage per key) and those it `refines` (a key an
earlier stage decided, which it may change with `decisions.refine`; or a value given, not decided, that it
adjusts: the batch part scales a given LR). `run_event` checks each stage against its declaration: a key it
decided or refined undeclared is logged as a warning, or raises `UndeclaredDecision` where
`TORCHSPEED_STAGE_CHECK=raise` (the test suite sets it).

Example:
    >>> register_stage(Stage("my_probe", "before", lambda ctx: ctx.decisions.__setitem__(
    ...     "my_probe", Decision(1, "measured")), writes=("my_probe",)))
    >>> make_plan(model, loader, TrainConfig()).decisions["my_probe"]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from torchspeed.env import DeviceCaps
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decision, Decisions, TrialCache
from torchspeed.train.parallel.distributed import DistInfo
from torchspeed.train.sampler import loader_length, rebuild_loader
from torchspeed.train.schedule import steps_in_run

log = logging.getLogger("torchspeed")

__all__ = ["EVENTS", "Stage", "RunContext", "STAGES", "register_stage", "unregister_stage", "stages", "run_event",
           "RunStages", "first_steps_hook", "render_stages", "run_length", "UndeclaredDecision", "undeclared"]

EVENTS = ("before", "first_steps", "after_switches", "after")


@dataclass(frozen=True)
class Stage:
    """One automatic choice: `run(ctx)` at `event`, after the stages it `needs`; `when(ctx)`: whether it is wanted
    (an "after_switches" stage that is not wanted adds nothing to the run's steps); `cost`: its cost in words;
    `writes`: the decision keys it decides; `refines`: the keys it may refine (see the module docstring); `last`:
    it runs after every other stage of its event."""

    name: str
    event: str
    run: Callable[["RunContext"], None]
    needs: tuple[str, ...] = ()
    cost: str = "0 steps"
    what: str = ""
    fallback: bool = True
    when: Callable[["RunContext"], bool] | None = None
    writes: tuple[str, ...] = ()
    refines: tuple[str, ...] = ()
    last: bool = False

    def __post_init__(self):
        if self.event not in EVENTS:
            raise ValueError(f"Stage {self.name!r}: event {self.event!r} is not one of {EVENTS}")

    def wanted(self, ctx: "RunContext") -> bool:
        return self.when is None or bool(self.when(ctx))


@dataclass
class RunContext:
    """What the stages share, each value resolved once: the `fit` call's arguments, then what stages resolved."""

    model: nn.Module
    loader: Iterable
    cfg: TrainConfig
    optimizer: str | torch.optim.Optimizer = "sgd"
    lr: float | str | None = None
    weight_decay: float | None = None
    optimizer_options: dict | None = None
    loss_fn: Callable | None = None
    step_fn: Callable | None = None
    device: torch.device | str | None = None     # as asked; `dev` is what the capabilities stage resolved
    batch_size: int | str | None = None
    loader_mode: str | None = None
    recipe: str | None = None
    recipe_parts: Sequence[str] | None = None
    schedule_given: bool = True
    cache: TrialCache | None = None
    callbacks: list = field(default_factory=list)
    decisions: Decisions = field(default_factory=Decisions)
    # resolved by the stages
    dist: DistInfo | None = None
    dev: torch.device | None = None
    caps: DeviceCaps | None = None
    precision: str | None = None                  # the switch trial's, when it ran before the measuring stages
    switches: tuple | None = None                 # and its (Switches, report): the run takes it, no second trial
    own_lr: bool = False                          # the run gave its own LR (train.schedule.lr_given)
    run_steps: int | None = None
    rec: object = None                            # the recipe (plan.parts.Recipe) when one was chosen
    tuning_steps: int = 0                         # training steps off the run spent choosing
    trainer: object = None                        # "first_steps", "after_switches" and "after": the Trainer
    run_loader: Iterable | None = None            # "first_steps": the loader the Trainer trains on (sliced, sharded)
    steps_left: int | None = None                 # "first_steps": the run's micro-batches left (None: unknown)
    result: object = None                         # "after": the FitResult
    val_loader: Iterable | None = None
    loader_changes: dict = field(default_factory=dict)  # batch size and DataLoader settings the stages chose: the
    # "loader" stage rebuilds the loader with them, once, last (a stage assigns a new dict: a failed one's goes back)
    shared: object = None                         # what the recipe's part-stages share (plan.parts.Shared)
    _planned: tuple | None = field(default=None, repr=False)

    def planned_loader(self) -> Iterable:
        """The loader as the stages so far decided it: `loader` with `loader_changes` (the stages that read batches
        before the "loader" stage read these; it is built once per change, and the "loader" stage adopts it)."""
        if not self.loader_changes:
            return self.loader
        key = repr(sorted(self.loader_changes.items()))
        if self._planned is None or self._planned[0] != key:
            self._planned = (key, rebuild_loader(self.loader, **self.loader_changes))
        return self._planned[1]


STAGES: dict[str, Stage] = {}


def run_length(loader: Iterable, cfg: TrainConfig) -> int | None:
    """The run's optimizer steps: epochs x the loader's length, or max_steps (None: unknown)."""
    return steps_in_run(loader_length(loader, max_steps=cfg.max_steps), cfg.epochs, grad_accum=cfg.grad_accum,
                        max_steps=cfg.max_steps)


def register_stage(stage: Stage, *, replace: bool = False) -> Stage:
    """Add `stage` to the plan (after the stages registered before it, and after those it `needs`)."""
    if stage.name in STAGES and not replace:
        raise ValueError(f"a stage named {stage.name!r} is already registered (replace=True replaces it)")
    STAGES[stage.name] = stage
    return stage


def unregister_stage(name: str) -> None:
    STAGES.pop(name, None)


def stages(event: str) -> list[Stage]:
    """The registered stages of `event`, in registration order, each after the stages it needs; those marked
    `last` after every other."""
    mine = [s for s in STAGES.values() if s.event == event and not s.last]
    mine += [s for s in STAGES.values() if s.event == event and s.last]
    names = {s.name for s in mine}
    done: list[Stage] = []
    placed: set[str] = set()
    pending = list(mine)
    while pending:
        ready = next((s for s in pending if all(n in placed or n not in names for n in s.needs)), None)
        if ready is None:
            raise ValueError(f"the {event!r} stages {[s.name for s in pending]} need each other (a cycle)")
        pending.remove(ready)
        done.append(ready)
        placed.add(ready.name)
    return done


class UndeclaredDecision(RuntimeError):
    """A stage decided or refined a key it did not declare (`Stage.writes`, `Stage.refines`)."""


def undeclared(stage: Stage, before: dict, after: dict) -> dict[str, str]:
    """The keys `stage` decided or refined undeclared, from the decisions `before` and `after` it ran:
    {key: "decided" | "refined"}. A key it decided must be in its `writes` or `refines`; a key decided before it
    that it changed, in its `refines`."""
    out = {}
    for key, dec in after.items():
        if key not in before:
            if key not in stage.writes and key not in stage.refines:
                out[key] = "decided"
        elif dec is not before[key] and key not in stage.refines:
            out[key] = "refined"
    return out


def _check(stage: Stage, before: dict, ctx: RunContext) -> None:
    wrong = undeclared(stage, before, ctx.decisions)
    if not wrong:
        return
    words = ", ".join(f"{how} {key!r}" for key, how in wrong.items())
    msg = (f"the stage {stage.name!r} {words} without declaring it (Stage(writes=..., refines=...); "
           f"it declares writes={stage.writes}, refines={stage.refines})")
    if os.environ.get("TORCHSPEED_STAGE_CHECK") == "raise":
        raise UndeclaredDecision(msg)
    log.warning("torchspeed: %s", msg)


def _run(stage: Stage, ctx: RunContext) -> None:
    before = dict(ctx.decisions)
    if not stage.fallback:
        stage.run(ctx)
        return _check(stage, before, ctx)
    prior = dict(vars(ctx), callbacks=list(ctx.callbacks))  # what the context held before the stage
    try:
        stage.run(ctx)
    except Exception as e:  # noqa: BLE001 - a stage that fails leaves the run what it had before the stage
        _check(stage, before, ctx)
        callbacks = prior.pop("callbacks")
        vars(ctx).update(prior)
        ctx.callbacks[:] = callbacks  # (the same list the plan hands the Trainer)
        first = (str(e).strip().splitlines() or [""])[0][:160]
        ctx.decisions.refine(stage.name, Decision("failed", f"the stage {stage.name!r} failed ({type(e).__name__}: "
                                                            f"{first}); the run goes on with its prior"))
        log.warning("torchspeed: the stage %r failed (%s: %s); the run goes on with its prior", stage.name,
                    type(e).__name__, first)
        return
    _check(stage, before, ctx)


def run_event(ctx: RunContext, event: str) -> None:
    """Run every wanted stage of `event` in order."""
    for stage in stages(event):
        if stage.wanted(ctx):
            _run(stage, ctx)


def first_steps_hook(ctx: RunContext) -> Callable:
    """What the plan hands the Trainer (`Trainer(first_steps=...)`): at the start of its run, the "first_steps"
    stages run with the trainer, the loader it trains on and the steps left."""

    def arm(trainer, loader: Iterable, steps_left: int | None) -> None:
        ctx.trainer, ctx.run_loader, ctx.steps_left = trainer, loader, steps_left
        run_event(ctx, "first_steps")

    return arm


class RunStages(Callback):
    """The "after_switches" stages, run once at the first step end after the switch trial has settled."""

    def __init__(self, ctx: RunContext):
        self.ctx, self.done = ctx, False

    def on_step_end(self, trainer) -> None:
        if self.done or trainer.stepper is not None:  # the switch trial still steps the run
            return
        self.done = True
        self.ctx.trainer = trainer
        run_event(self.ctx, "after_switches")


def render_stages() -> str:
    """The registered stages as the Markdown table docs/architecture.md shows (tests compare the two)."""
    rows = ["| event | stage | needs | writes | refines | cost | what it decides |", "|---|---|---|---|---|---|---|"]
    for event in EVENTS:
        for s in stages(event):
            keys = [", ".join(f"`{k}`" for k in ks) or "-" for ks in (s.writes, s.refines)]
            rows.append(f"| {event} | `{s.name}` | {', '.join(s.needs) or '-'} | {keys[0]} | {keys[1]} | {s.cost} "
                        f"| {s.what} |")
    return "\n".join(rows)
