"""Learning-rate schedules and the batch-size scaling rule (T14, T16, T17).

- one-cycle (T14): warm up to `max_lr`, anneal far below it; trains in fewer epochs. It
  also cycles momentum (SGD) or beta1 (Adam) inversely, within +-0.05 of the optimizer's
  own value (0.9 gives torch's default 0.85-0.95), so a momentum you set is the one used;
  each param group around its own value (the Muon and AdamW parts of "muon", T42).
- cyclic (T14): triangular cycles between `min_lr` and `max_lr`.
- warmup + cosine (T16): linear warm-up, then cosine decay to `min_lr`.
- warmup-stable-decay, "wsd" (T16's alternative; Hu et al. 2024, MiniCPM; Hagele et al. 2024): linear warm-up,
  the peak LR held, then the last `WSD_DECAY` (20%) of the steps cooled to `min_lr` (0) by 1 - sqrt, the cooldown
  shape Hagele et al. found best.
- linear decay to zero, "linear" (Bergsma et al. 2025, "Straight to Zero"): linear warm-up, then a straight line
  from the peak to `min_lr` (0) at the last step.
- constant: the LR as set (after a linear warm-up over `warmup_steps`, when given).
- `default_schedule`: the schedule of a `fit` run that did not name one. A run whose LR the user
  set (a number, or an optimizer object that carries its own) trains at that LR: constant, as the
  loop it was ported from. A run whose LR torchspeed chooses (`lr="auto"`, `recipe="auto"`) or
  that set none (the default 0.1) gets one-cycle around it.
- `scale_lr` (T17): the linear scaling rule lr = base_lr x world_size x batch / base_batch.
- `scale_lr_for_batch` (T17): the LR for another batch by the optimizer's rule (`lr_rule`):
  linear for SGD and LARS, the square root for the Adam family; the recipe's batch part and the
  batch-size warm-up (`batch_ramp.py`) both use it.

Every scheduler here is stepped once per optimizer step (not per epoch).

- **Your own scheduler**: `schedule=` may be a function of the optimizer that builds any torch LR
  scheduler (`lambda opt: StepLR(opt, step_size=1, gamma=0.7)`), as the script being ported built
  it. A scheduler object is taken too when it was built on the optimizer object passed to `fit`
  (`optimizer=opt, schedule=StepLR(opt, ...)`: `BuiltScheduler`); with an optimizer named by a
  string, or a recipe part that replaces the optimizer (Schedule-Free), only a function can be built
  on the optimizer that trains, and a bound object gets an error that says so. It is stepped
  after each epoch (`schedule_interval="epoch"`, as torch's examples and Lightning do by default;
  `EpochScheduler`), or after each optimizer step (`"step"`); `ReduceLROnPlateau` steps on the
  epoch's validation loss (its accuracy with `mode="max"`). Its state is checkpointed and resumed.

Example:
    >>> sched = create_scheduler("onecycle", opt, total_steps=1000, max_lr=0.4)
"""

from __future__ import annotations

import math

import torch

from torchspeed.train.decision import Decision
from torchspeed.train.optim_info import OPTIM_INFO, default_lr

__all__ = ["SCHEDULES", "lr_given", "default_schedule", "create_scheduler", "scale_lr", "EpochScheduler",
           "schedule_label", "INTERVALS", "BuiltScheduler", "as_schedule",
           "warmup_cosine_factor", "wsd_factor", "linear_decay_factor", "WSD_DECAY", "steps_in_run", "lr_rule",
           "batch_lr_factor", "scale_lr_for_batch", "rescale_lr"]

SCHEDULES = ("onecycle", "cyclic", "cosine", "wsd", "linear", "constant")
WSD_DECAY = 0.2  # wsd: the share of the steps its cooldown takes
INTERVALS = ("epoch", "step")  # when a schedule of your own is stepped


def lr_given(lr: float | str | None, optimizer: object) -> bool:
    """Whether the run set its own LR: a number, or an optimizer object (it carries the user's LR)."""
    return isinstance(optimizer, torch.optim.Optimizer) or (lr is not None and lr != "auto")


def default_schedule(*, lr: float | str | None, optimizer: object, recipe: str | None = None) -> Decision:
    """The schedule of a run that named none, and why: the LR the user set is the LR the run trains at.

    - `lr="auto"`, or `recipe="auto"` with no LR given: "onecycle" (the LR is chosen as a one-cycle peak);
    - an LR given as a number, or an optimizer object (it carries the user's LR), with a recipe or not: "constant";
    - no LR given: "onecycle" around the optimizer's own default LR (`optim_info.default_lr`: SGD 0.1, AdamW 1e-3).
    """
    given = lr_given(lr, optimizer)
    if lr == "auto" or (recipe == "auto" and not given):
        return Decision("onecycle", "rule: the LR is chosen as the peak of a one-cycle schedule")
    if given:
        what = "the optimizer's LR" if isinstance(optimizer, torch.optim.Optimizer) else f"lr={lr:g}"
        return Decision("constant", f"rule: you set {what}, so the run trains at it as a loop without a "
                        "scheduler does; pass schedule='onecycle' (or 'cosine') to anneal it")
    name = optimizer if isinstance(optimizer, str) else "the optimizer"
    return Decision("onecycle", f"rule: no LR given, so one-cycle around lr={default_lr(optimizer):g} ({name}'s "
                                "default LR)")


def steps_in_run(steps_per_epoch: int | None, epochs: int, *, grad_accum: int = 1,
                 max_steps: int | None = None) -> int | None:
    """Optimizer steps a run takes: epochs x ceil(batches per epoch / grad_accum), capped by max_steps
    (None: unknown, a loader without len() and no max_steps)."""
    total = max(1, math.ceil(steps_per_epoch / grad_accum) * epochs) if steps_per_epoch else None
    return min(total, max_steps) if total and max_steps else (total or max_steps)


def scale_lr(base_lr: float, batch: int, base_batch: int, world_size: int = 1) -> float:
    """Linear scaling rule (T17): the LR grows with the global batch."""
    if batch <= 0 or base_batch <= 0 or world_size <= 0:
        raise ValueError("batch, base_batch and world_size must be positive")
    return base_lr * world_size * batch / base_batch


def lr_rule(optimizer: torch.optim.Optimizer | str | None) -> str:
    """"sqrt" for the Adam family, else "linear" (SGD, LARS): a name's row says (`optim_info`; an unknown name:
    "linear"); an optimizer object is of the Adam family when it has betas."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return "sqrt" if "betas" in optimizer.defaults else "linear"
    info = OPTIM_INFO.get((optimizer or "").lower())
    return info.lr_rule if info else "linear"


def batch_lr_factor(batch: int, ref_batch: int, rule: str = "linear") -> float:
    """The LR factor for `batch` relative to the LR for `ref_batch`, by `rule` ("linear" or "sqrt")."""
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"rule must be 'linear' or 'sqrt', got {rule!r}")
    if batch <= 0 or ref_batch <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch} and {ref_batch}")
    ratio = batch / ref_batch
    return math.sqrt(ratio) if rule == "sqrt" else ratio


def scale_lr_for_batch(lr: float, batch: int, old_batch: int, optimizer: torch.optim.Optimizer | str | None) -> float:
    """The LR for `batch` when `lr` suited `old_batch`: the square root rule for Adam-family optimizers, else linear."""
    return lr * batch_lr_factor(batch, old_batch, lr_rule(optimizer))


def warmup_cosine_factor(step: int, *, total_steps: int, warmup_steps: int, min_factor: float = 0.0) -> float:
    """Multiplier of max_lr at `step`: linear warm-up, then cosine down to `min_factor`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def wsd_factor(step: int, *, total_steps: int, warmup_steps: int, min_factor: float = 0.0,
               decay: float = WSD_DECAY) -> float:
    """Multiplier of max_lr at `step`: linear warm-up, 1.0 held, then the last `decay` share of the steps cooled
    by 1 - sqrt(progress) to `min_factor` (reached at the last step)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    cool = max(1, round(decay * total_steps))
    start = max(warmup_steps, total_steps - cool)
    if step < start:
        return 1.0
    progress = min(1.0, (step - start + 1) / max(1, total_steps - start))
    return min_factor + (1 - min_factor) * (1 - math.sqrt(progress))


def linear_decay_factor(step: int, *, total_steps: int, warmup_steps: int, min_factor: float = 0.0) -> float:
    """Multiplier of max_lr at `step`: linear warm-up, then a straight line down to `min_factor` at the last step."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps + 1) / max(1, total_steps - warmup_steps))
    return min_factor + (1 - min_factor) * (1 - progress)


class EpochScheduler:
    """A scheduler of yours stepped after each epoch: the trainer's per-optimizer-step `step()` waits, and
    `epoch_end(row)` steps it (`ReduceLROnPlateau` on the epoch's `val_loss`, or `val_acc` in mode "max"; the
    training figures where the run has no validation; an epoch that `eval_every` left unvalidated does not step it).
    Its state is the scheduler's own."""

    def __init__(self, inner):
        self.inner = inner

    def step(self) -> None:
        pass

    def epoch_end(self, row: dict) -> None:
        if not isinstance(self.inner, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return self.inner.step()
        if row.get("val_skipped"):
            return None
        kind = "acc" if self.inner.mode == "max" else "loss"
        value = row.get(f"val_{kind}")
        value = value if value is not None else row.get(f"train_{kind}")
        if value is not None:
            self.inner.step(value)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str):  # (not called for `inner` itself: a copy or unpickling never recurses)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _is_scheduler(obj) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "state_dict") and hasattr(obj, "optimizer")


class BuiltScheduler:
    """A scheduler object passed as `schedule=` (`StepLR(opt, ...)`), as the function of the optimizer that every
    other own schedule is: it hands the scheduler over when asked for the optimizer it was built on, and refuses,
    naming the fix, for any other (an optimizer fit built from a name, or one a recipe part replaced)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.__qualname__ = type(scheduler).__name__

    def __call__(self, optimizer: torch.optim.Optimizer):
        if self.scheduler.optimizer is not optimizer:
            name = type(self.scheduler).__name__
            raise TypeError(f"schedule= got a {name} object built on another optimizer than the one this run trains "
                            f"(a {type(optimizer).__name__}): pass the optimizer it was built on as optimizer=, or "
                            f"the function that builds the scheduler, schedule=lambda opt: {name}(opt, ...)")
        return self.scheduler


def as_schedule(schedule):
    """`schedule=` as the run keeps it: a scheduler object becomes a `BuiltScheduler`; anything else as given."""
    return BuiltScheduler(schedule) if _is_scheduler(schedule) and not callable(schedule) else schedule


def _own_scheduler(factory, optimizer: torch.optim.Optimizer, interval: str):
    if interval not in INTERVALS:
        raise ValueError(f"schedule_interval must be one of {INTERVALS}, got {interval!r}")
    try:
        sched = factory(optimizer)
    except TypeError as e:
        if not isinstance(factory, type):
            raise
        raise TypeError(f"schedule= got the class {factory.__name__}, which needs more than the optimizer ({e}): "
                        f"pass a function that builds it, schedule=lambda opt: {factory.__name__}(opt, ...)") from None
    scheduler = hasattr(sched, "step") and hasattr(sched, "state_dict")
    if not scheduler or getattr(sched, "optimizer", None) is not optimizer:
        raise TypeError("schedule=<a function> must build an LR scheduler on the optimizer it is given, e.g. "
                        "schedule=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7); it "
                        f"returned {type(sched).__name__}" + (" bound to another optimizer" if scheduler else ""))
    if interval == "step":
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError("ReduceLROnPlateau steps on an epoch's metric: use schedule_interval='epoch'")
        return sched
    return EpochScheduler(sched)


def schedule_label(schedule) -> str:
    """A schedule in words: its name, or "yours (<the function>)" for a function that builds one."""
    if callable(schedule):
        return f"yours ({getattr(schedule, '__qualname__', type(schedule).__name__)})"
    return schedule or "constant"


def create_scheduler(name, optimizer: torch.optim.Optimizer, *, total_steps: int,
                     max_lr: float | None = None, min_lr: float | None = None,
                     warmup_steps: int | None = None, cycle_steps: int | None = None, interval: str = "epoch"):
    """Build schedule `name` for `total_steps` optimizer steps (None, or "constant" without `warmup_steps`: no
    scheduler); `name` a function of the optimizer: your own scheduler, stepped per `interval` (see above)."""
    if callable(name):
        return _own_scheduler(name, optimizer, interval)
    if _is_scheduler(name):
        return _own_scheduler(BuiltScheduler(name), optimizer, interval)
    if name == "constant" and warmup_steps:
        warm = int(warmup_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    if name is None or name == "constant":
        return None
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    max_lr = max_lr if max_lr is not None else optimizer.param_groups[0]["lr"]
    has_momentum = "momentum" in optimizer.defaults or "betas" in optimizer.defaults
    if name == "onecycle":
        if total_steps < 4:  # OneCycleLR needs >= 2 steps in each phase; so short a run keeps the LR
            return None
        pct = 0.25 if warmup_steps is None else min(0.9, max(warmup_steps, 1) / total_steps)
        pct = min(max(pct, 2 / total_steps), 1 - 2 / total_steps)
        div = 25.0 if min_lr is None else max_lr / min_lr
        # each group's own beta1 (Adam) or momentum (SGD; MuonAdamW, whose groups differ), as OneCycleLR reads them
        beta1 = "betas" in optimizer.defaults
        ms = [g["betas"][0] if beta1 else g.get("momentum", 0.0) for g in optimizer.param_groups]
        base = [max(0.0, m - 0.05) for m in ms]
        peak = [min(0.999, m + 0.05) for m in ms]
        same = len(set(ms)) == 1
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=max_lr, total_steps=total_steps, pct_start=pct, div_factor=div,
            cycle_momentum=has_momentum and min(ms) > 0, base_momentum=base[0] if same else base,
            max_momentum=peak[0] if same else peak, anneal_strategy="cos")
    if name == "cyclic":
        base = min_lr if min_lr is not None else max_lr / 10
        half = max(1, (cycle_steps or max(2, total_steps // 4)) // 2)
        return torch.optim.lr_scheduler.CyclicLR(
            optimizer, base_lr=base, max_lr=max_lr, step_size_up=half, mode="triangular2",
            cycle_momentum="momentum" in optimizer.defaults)
    if name in _DECAYS:
        warm = warmup_steps if warmup_steps is not None else max(1, total_steps // 20)
        floor = (min_lr / max_lr) if min_lr is not None else 0.0
        for g in optimizer.param_groups:
            g["lr"] = max_lr
            g.setdefault("initial_lr", max_lr)
        shape = _DECAYS[name]
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: shape(s, total_steps=total_steps, warmup_steps=warm, min_factor=floor))
    raise ValueError(f"schedule {name!r} is not one of {', '.join(SCHEDULES)}")


_DECAYS = {"cosine": warmup_cosine_factor, "wsd": wsd_factor, "linear": linear_decay_factor}  # warm-up, then decay


def rescale_lr(optimizer: torch.optim.Optimizer, scheduler, factor: float) -> None:
    """Multiply a running schedule's LRs by `factor` in place, keeping its shape and position: the current LR,
    the peak, start and floor of every group (OneCycleLR, cosine's LambdaLR, CyclicLR), so a peak LR measured
    during the run's first steps takes over from the one it started with."""
    for g in optimizer.param_groups:
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):
            if key in g and isinstance(g[key], (int, float)):
                g[key] = g[key] * factor
    if scheduler is None:
        return
    for attr in ("base_lrs", "max_lrs", "_last_lr"):
        vals = getattr(scheduler, attr, None)
        if isinstance(vals, list):
            setattr(scheduler, attr, [v * factor for v in vals])
