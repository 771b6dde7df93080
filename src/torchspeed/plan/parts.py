"""What the recipe's parts share: the `Recipe` they fill in, the `Gate` that lets a part measure within the tuning
budget (or reads the cache, or keeps the prior), `Shared` (what the `recipe_setup` stage holds for the parts: the
Gate, the classifier check, the RNG held while they measure), and `guarded`, which runs one part so that a part that
raises is named and the run goes on with that part's prior (T14, T15, T17, T32, T33, T40, T42, T47).

Each part is a stage of the plan (`plan.planner.BUILT_IN`, in order): a function of the `RunContext` in its own
module (`recipe_optimizer`, `recipe_lr`, `recipe_batch`, `recipe_tta`; the set-up, the free parts and the recipe's
fold into the run in `recipe`), which reads `ctx.rec` and `ctx.shared` and writes its Decisions into the plan's
(`Recipe.decisions` is the plan's `Decisions`). They import this module and not each other.

Example:
    >>> rec = Recipe(lr=0.1)
    >>> guarded(rec, "lr", {"lr": 0.1}, 0.1, lambda: 1 / 0)   # reported; rec.lr stays 0.1
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import torch

from torchspeed.env import detect
from torchspeed.plan.budget import TuningBudget
from torchspeed.train.bnstats import FinalBatchNormStats
from torchspeed.train.loop.callbacks import EMA
from torchspeed.train.decision import Decision, DecisionConflict, Decisions, TrialCache
from torchspeed.train.losses import default_loss
from torchspeed.train.trial.switch_choice import batch_signature, model_signature

log = logging.getLogger("torchspeed")

__all__ = ["PARTS", "EMA_MIN_STEPS", "Recipe", "Gate", "Shared", "recipe_key", "guarded", "choose_ema",
           "loss_for_tuning"]

PARTS = ("lr", "label_smoothing", "bn_stats", "ema", "tta", "muon", "schedulefree", "batch")
EMA_MIN_STEPS = 2000


@dataclass
class Recipe:
    """What the recipe's parts picked; `config()` and `callbacks()` hand it to `fit`/`Trainer`."""

    lr: float | None = None              # one-cycle peak LR (None: the caller's own)
    min_lr: float | None = None          # the schedule's floor (None: the schedule's default)
    label_smoothing: float = 0.0
    bn_stats: bool = False
    ema_decay: float | None = None
    optimizer: str | None = None         # "muon" when the trial picked it (None: the caller's)
    schedule: str | None = None          # the prior's schedule ("wsd") where it names one (None: the plan's)
    batch_size: int | None = None        # the batch part's choice (None: the loader's own)
    tta: str | None = None               # decided after training (choose_tta)
    parts: tuple[str, ...] = PARTS
    tuning_s: float = 0.0                # seconds spent choosing
    tuning_steps: int = 0                # training steps (forward + backward) spent choosing
    decisions: Decisions = field(default_factory=Decisions)
    pending: dict = field(default_factory=dict)  # parts measured later, in the run's first steps (plan/inrun.py)
    probe: list = field(default_factory=list, repr=False)  # training batches for choose_tta

    def config(self) -> dict:
        """The `TrainConfig` fields this recipe sets."""
        out: dict = {"label_smoothing": self.label_smoothing}
        if self.schedule is not None:
            out["schedule"] = self.schedule
        if self.min_lr is not None:
            out["min_lr"] = self.min_lr
        return out

    def callbacks(self) -> list:
        """The callbacks this recipe adds: BatchNorm statistics over the last steps, an EMA."""
        cbs: list = []
        if self.bn_stats:
            cbs.append(FinalBatchNormStats())
        if self.ema_decay is not None:
            cbs.append(EMA(self.ema_decay))
        return cbs

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("probe")
        d["decisions"] = {k: str(v) for k, v in self.decisions.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k not in ("probe", "decisions")}
        if "parts" in known:
            known["parts"] = tuple(known["parts"])
        return cls(**known)


def guarded(rec: Recipe, part: str, prior: dict, value, fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, one recipe part: one that raises is reported with its name (a warning, and the
    Decision `value` with why) and the run goes on with the part's `prior` (the Recipe fields it sets back): a
    failed part never ends a run. Returns what `fn` returned, or None when it raised. A `DecisionConflict` (a key
    decided twice: a fault of the plan, not of the measurement) is raised."""
    try:
        return fn(*args, **kwargs)
    except DecisionConflict:  # two writers of one key: a fault of the plan, not of a measurement
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a measurement leaves the run its prior
        for field_name, kept in prior.items():
            setattr(rec, field_name, kept)
        rec.pending.pop(part, None)
        first = (str(e).strip().splitlines() or [""])[0][:160]
        shown = {k: v for k, v in prior.items() if v is not None} or "as given"
        rec.decisions.refine(part, Decision(value, f"the recipe part {part!r} failed ({type(e).__name__}: "
                                            f"{first}); the run goes on with its prior ({shown})"))
        log.warning("torchspeed: the recipe part %r failed (%s: %s); the run goes on with its prior", part,
                    type(e).__name__, first)
        return None


def recipe_key(model, batch, optimizer: str, lr: float, schedule, precision, parts) -> str:
    """The trial cache's key for the recipe measured on this model, input, optimizer, LR, schedule and machine."""
    info = detect()
    return TrialCache.key({"recipe": 1, "model": model_signature(model), "batch": batch_signature(batch),
                           "optimizer": optimizer, "lr": lr, "schedule": schedule, "precision": precision,
                           "parts": sorted(parts), "cpu": info.cpu_model, "device": info.device_name,
                           "torch": torch.__version__})


class Gate:
    """For each part that trains off the run: measure it (the budget allows), read an earlier run's measurement
    (the cache), or keep the prior; every way ends in a Decision that says which."""

    def __init__(self, rec: Recipe, budget: TuningBudget | None, cache: TrialCache | None, key: str):
        self.rec, self.budget, self.cache, self.key = rec, budget, cache, key
        self.hit = (cache.get(key) or {}) if cache is not None else {}
        self.new: dict = {}
        self.refused: dict[str, str] = {}

    def cached(self, part: str) -> dict | None:
        return self.hit.get(part)

    def measure(self, part: str, cost: int) -> bool:
        if part in self.hit:
            return False
        if self.budget is None or self.budget.allows(cost):
            if self.budget is not None:
                self.budget.spend(cost)
            return True
        self.refused[part] = self.budget.refusal(cost)
        return False

    def settle(self, part: str, field: str, prior, prior_words: str, *, default):
        """The value of `field` when `part` was not measured: cached, or the prior (`default`), with its Decision."""
        d = self.rec.decisions
        refused = self.refused.get(part)
        if part in self.hit:
            value = self.hit[part].get(field)
            d[part] = Decision(value if value is not None else prior, "cached: measured by an earlier run of this "
                               "model on this machine (0 steps now)", measured=self.hit[part])
            return value if value is not None else default
        d[part] = Decision(prior, f"prior: {prior_words}; not measured ({refused or 'part off'})")
        return default

    def done(self, part: str, values: dict) -> None:
        self.new[part] = values | {"decision": dict(self.rec.decisions.get(part) or {})}

    def save(self) -> None:
        if self.cache is not None and self.new:
            self.cache.put(self.key, self.hit | self.new)


@dataclass
class Shared:
    """What the recipe's part-stages share (`RunContext.shared`), set up once by the `recipe_setup` stage: the `Gate`
    (its budget, cache and key), whether the model is a classifier on the default loss, when choosing started, what
    one part found for a later one (the LR part's noise scale for the batch part; Schedule-Free's LR, chosen by the
    optimizer part, for the LR part's decision), and every RNG held from the set-up until the `recipe` stage."""

    gate: Gate
    classifier: bool
    started: float                              # time.perf_counter() at the set-up
    found: dict = field(default_factory=dict)
    rng: ExitStack = field(default_factory=ExitStack)


def choose_ema(rec: Recipe, total_steps: int | None, why: str = "") -> Decision:
    """The EMA part (T40): on for runs of EMA_MIN_STEPS+ steps, its average spanning about the last twentieth. The ema
    part decides it; the batch part, which shortens the run in steps, refines it."""
    if total_steps and total_steps >= EMA_MIN_STEPS:
        rec.ema_decay = round(min(0.9999, max(0.99, 1 - 20 / total_steps)), 6)
        return Decision(rec.ema_decay, f"a run of {total_steps} steps{why}: the average spans about its last "
                                       "twentieth (T40)")
    rec.ema_decay = None
    return Decision(None, f"run of {total_steps or 'unknown'} steps{why}, under {EMA_MIN_STEPS}: an average of "
                          "so few steps gained nothing measured (docs/recipe.md)")


def loss_for_tuning(ctx):
    """The loss the parts that train off the run train on (`ctx`: the plan's `RunContext`): the run's, with the
    smoothing the label_smoothing part (and the optimizer part) left it."""
    if ctx.loss_fn is None and ctx.rec.label_smoothing:
        return default_loss(ctx.rec.label_smoothing)
    return ctx.loss_fn
