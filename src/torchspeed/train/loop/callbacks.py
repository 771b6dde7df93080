"""Callbacks: your code at the events users know from Lightning and the HF Trainer, plus EarlyStopping and EMA.

Events (each receives the `Trainer`):

- `on_train_start(trainer)`: after a resume has restored every state, before the first step;
- `on_before_optimizer_step(trainer, optimizer)`: before each optimizer step that runs (not each accumulation
  micro-batch; not a step the NaN guard skips), with the gradients in place, unscaled under fp16, and before
  `clip_grad_norm`/`clip_grad_value` clip them (Lightning's order): read them (a gradient norm to log) or change
  them in place (a clipping of your own, gradient noise);
- `on_step_end(trainer)`: after each optimizer step (not each accumulation micro-batch);
- `on_evaluate(trainer, metrics)`: after each epoch's row is complete (train metrics, and
  `val_*` when there is a `val_loader`), before it is checkpointed; with `eval_every=N` under an
  epoch, also after each validation inside the epoch (`mid_epoch` True: the epoch, step, lr and `val_*`);
- `on_save(trainer, path)`: after a checkpoint file was written (rank 0);
- `on_train_end(trainer, status)`: once, with "success", or "failed" when an exception ends the run.

A callback stops training with `trainer.request_stop("why")`: the run ends after the current
step (from `on_step_end`, or `on_evaluate` inside an epoch) or epoch (from `on_evaluate`), and
`FitResult.decisions["stopped"]` says why. Under DDP a callback must decide the same on every rank
(the epoch metrics are already reduced over ranks, so EarlyStopping does). A callback that keeps state returns it from
`state_dict()` (tensors and plain values: checkpoints load with `weights_only=True`); it is saved
in every checkpoint and given back to `load_state_dict` on resume, so a resumed run is exact.

Built in: `EarlyStopping` and `EMA` (T40: an exponential moving average of the weights on
`torch.optim.swa_utils.AveragedModel`, usable in your own loop too). The trainer talks to all
of them through one `CallbackList`, one line per event.

Cost: one Python call per optimizer step for each callback that overrides `on_step_end` or
`on_before_optimizer_step`, none when no callback does (the loop then skips the event); nothing reads the device
unless the callback does (EarlyStopping reads the epoch row, which is already on the host; EMA's update is
one `torch._foreach_lerp_` over the weights per step, on the device).

Example:
    >>> fit(model, loader, epochs=30, val_loader=val, callbacks=[EarlyStopping("val_loss", patience=3), EMA(0.999)])
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

__all__ = ["Callback", "CallbackList", "EarlyStopping", "EMA", "as_list"]

log = logging.getLogger("torchspeed")


class Callback:
    """Base class: override the events you need; `state_dict`/`load_state_dict` for state kept across a resume."""

    def on_train_start(self, trainer) -> None:
        pass

    def on_before_optimizer_step(self, trainer, optimizer) -> None:
        pass

    def on_step_end(self, trainer) -> None:
        pass

    def on_evaluate(self, trainer, metrics: dict) -> None:
        pass

    def on_save(self, trainer, path) -> None:
        pass

    def on_train_end(self, trainer, status: str) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def as_list(callbacks) -> list:
    """`callbacks=` as a list: one callback given alone (`callbacks=EarlyStopping()`) is a list of one."""
    return [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])


class CallbackList:
    """The trainer's one handle on its callbacks: each event is one call that goes to every callback in order.

    Besides the events, two hooks let a callback change what is evaluated and what best.pt
    holds (EMA uses both): `eval_module(module)` and `best_state(state)`.
    """

    def __init__(self, callbacks: Iterable[Callback] | None = None):
        self.callbacks: list[Callback] = as_list(callbacks)
        for i, cb in enumerate(self.callbacks):
            if isinstance(cb, type) and issubclass(cb, Callback):
                raise TypeError(f"callbacks[{i}] is the class {cb.__name__}: pass an instance, {cb.__name__}(...)")
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks[{i}] ({type(cb).__name__}) is not a torchspeed Callback: subclass "
                                "torchspeed.train.loop.callbacks.Callback and override the events you need "
                                "(loggers go to loggers=[...])")
        self._refresh()

    def add(self, cb: Callback) -> None:
        """Append a callback (after the run's own): it gets every event from now on."""
        self.callbacks.append(cb)
        self._refresh()

    def _refresh(self) -> None:
        # The callbacks that override on_step_end: the loop calls this event per step only when there is one.
        self.step_hooks: list[Callback] = [cb for cb in self.callbacks
                                           if type(cb).on_step_end is not Callback.on_step_end]
        before = Callback.on_before_optimizer_step  # and those that override it: the step skips an empty event
        self.grad_hooks: list[Callback] = [cb for cb in self.callbacks
                                           if type(cb).on_before_optimizer_step is not before]

    def __iter__(self):
        return iter(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    @contextlib.contextmanager
    def running(self, trainer):
        """`on_train_start` on entry; `on_train_end` on exit, "success" or "failed" (an exception)."""
        self._refresh()  # a callback appended to `callbacks` directly is seen from here on
        self.on_train_start(trainer)
        status = "failed"
        try:
            yield self
            status = "success"
        finally:
            self.on_train_end(trainer, status)

    def on_train_start(self, trainer) -> None:
        for cb in self.callbacks:
            cb.on_train_start(trainer)

    def on_before_optimizer_step(self, trainer, optimizer) -> None:
        for cb in self.grad_hooks:
            cb.on_before_optimizer_step(trainer, optimizer)

    def on_step_end(self, trainer) -> None:
        for cb in self.step_hooks:
            cb.on_step_end(trainer)

    def on_evaluate(self, trainer, metrics: dict) -> None:
        for cb in self.callbacks:
            cb.on_evaluate(trainer, metrics)

    def on_save(self, trainer, path) -> None:
        for cb in self.callbacks:
            cb.on_save(trainer, path)

    def on_train_end(self, trainer, status: str) -> None:
        for cb in self.callbacks:
            cb.on_train_end(trainer, status)

    def eval_module(self, module: nn.Module) -> nn.Module:
        """The module validation runs (the EMA weights when an EMA callback is on)."""
        for cb in self.callbacks:
            module = getattr(cb, "eval_module", lambda m: m)(module)
        return module

    def best_state(self, state: dict) -> dict:
        """The checkpoint state written to best.pt (EMA: its weights as "model", the live ones kept)."""
        for cb in self.callbacks:
            state = getattr(cb, "best_state", lambda s: s)(state)
        return state

    def _keys(self) -> list[str]:
        seen: dict[str, int] = {}
        keys = []
        for cb in self.callbacks:
            name = type(cb).__name__
            keys.append(name if name not in seen else f"{name}#{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
        return keys

    def state_dict(self) -> dict:
        return {k: cb.state_dict() for k, cb in zip(self._keys(), self.callbacks)}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        for k, cb in zip(self._keys(), self.callbacks):
            if k in state:
                cb.load_state_dict(state[k])
            elif type(cb).state_dict is not Callback.state_dict:  # it keeps state, and the checkpoint has none
                log.warning("resume: the checkpoint has no state for callback %s; it starts afresh", k)


class EarlyStopping(Callback):
    """Stop when epoch metric `metric` has not improved by more than `min_delta` for `patience` epochs (evaluations,
    with `eval_every=N` under an epoch: each validation inside an epoch and at its end counts).

    `mode` "min" (losses), "max" (accuracies), or "auto" ("max" when the name has "acc").
    The metric is read from each epoch's row (`val_loss`, `val_acc`, `train_loss`, ...); a
    non-finite value counts as no improvement. Its state (best value, epochs waited) is in
    every checkpoint, so a resumed run stops at the same epoch.

    Example:
        >>> fit(model, loader, epochs=100, val_loader=val, callbacks=[EarlyStopping("val_loss", patience=5)])
    """

    def __init__(self, metric: str = "val_loss", *, patience: int = 3, mode: str = "auto", min_delta: float = 0.0):
        if patience < 1:
            raise ValueError(f"patience must be >= 1 epoch, got {patience}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
        if min_delta < 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta}")
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.mode = ("max" if "acc" in metric else "min") if mode == "auto" else mode
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.wait = 0
        self.stopped_epoch: int | None = None

    def improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def on_evaluate(self, trainer, metrics: dict) -> None:
        value = metrics.get(self.metric)
        if value is None and (metrics.get("val_skipped") or metrics.get("mid_epoch")):
            return  # eval_every left this epoch's validation out, or a validation inside the epoch has no train_*
        if value is None:
            have = ", ".join(k for k, v in metrics.items() if isinstance(v, (int, float)))
            raise ValueError(f"EarlyStopping: no epoch metric {self.metric!r} (this run has: {have}); "
                             "pass val_loader= for val_* metrics, or pick one of these")
        value = float(value)
        if self.improved(value):
            self.best, self.best_epoch, self.wait = value, int(metrics["epoch"]), 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = int(metrics["epoch"])
            best = "none finite" if self.best is None else f"best {self.best:.4g} at epoch {self.best_epoch}"
            inside = f" (step {metrics['step']})" if metrics.get("mid_epoch") else ""
            mid = getattr(getattr(trainer, "_eval", None), "mid", None)  # eval_every under an epoch
            counted = "epoch(s)" if mid is None else "evaluation(s)"
            trainer.request_stop(f"early stopping at epoch {self.stopped_epoch}{inside}: {self.metric} did not "
                                 f"improve for {self.patience} {counted} ({best})")

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait,
                "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.wait, self.stopped_epoch = int(state["wait"]), state["stopped_epoch"]


class EMA(Callback):
    """An exponential moving average of the weights: `ema = d * ema + (1 - d) * weights` every step.

    Built on `torch.optim.swa_utils.AveragedModel` with `get_ema_multi_avg_fn(d)` (one fused
    `_foreach_lerp_` per dtype and device). The first update copies the weights.

    `warmup=True` (default): update t (from 0) uses d = min(decay, (1 + t) / (10 + t)), as timm's
    and TensorFlow's EMAs do: early on the average spans about the last tenth of the steps taken,
    so it never holds much of the random initial weights (without it, decay 0.98 after 40 steps
    is still 45% initial weights: chance accuracy on the digits, docs/integrations.md); `decay`
    caps d once the run is longer than about 9 / (1 - decay) steps. `warmup=False`: d = decay.

    State: the `AveragedModel` (a copy of the model: its `module` holds the averaged
    parameters and buffers, and `n_averaged` counts updates). Buffers (BatchNorm running
    mean/var) follow `buffers`: "average" (default) averages them like the weights, so the
    statistics match the averaged weights (integer buffers such as `num_batches_tracked` then
    hold a rounded average: BatchNorm only reads them when `momentum=None`); "copy" copies the
    live model's buffers at each update. `state_dict()` holds all of it as tensors.

    In `fit` (`callbacks=[EMA(0.999)]`): the EMA updates after every optimizer step, every
    validation evaluates the EMA weights (so `val_*`, `best_metric` and best.pt follow them;
    best.pt stores the EMA weights as "model" and the training weights as "train_model", which a
    resume from best.pt uses), every checkpoint carries the EMA state and a resume restores it,
    so a resumed run stays bit-exact. At the end of training the EMA weights are copied into the
    model (`apply_at_end=False` keeps the trained weights; the EMA is then `ema.module`).

    In your own loop it is a plain object:
        >>> ema = EMA(0.999).attach(model)
        >>> for x, y in loader:
        ...     loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        ...     ema.update()
        >>> evaluate(ema.module, val_loader)

    `decay`: the average spans about 1 / (1 - decay) steps (0.999: 1000 steps); pick it so that
    span is a small part of the run (see docs/integrations.md for measured numbers).
    """

    def __init__(self, decay: float = 0.999, *, warmup: bool = True, buffers: str = "average",
                 apply_at_end: bool = True):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        if buffers not in ("average", "copy"):
            raise ValueError(f"buffers must be 'average' or 'copy', got {buffers!r}")
        self.decay, self.warmup, self.buffers, self.apply_at_end = decay, warmup, buffers, apply_at_end
        self.updates = 0  # counted on the host: the warm-up reads no device tensor
        self.model: nn.Module | None = None
        self.averaged: AveragedModel | None = None
        self._pending: dict | None = None

    # ------------------------------------------------------------------ the plain object
    def attach(self, model: nn.Module) -> "EMA":
        """Start averaging `model` (a copy of it is kept on the same device); returns self."""
        self.model = model
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(self.decay),
                                      use_buffers=self.buffers == "average")
        self.updates = 0
        self.averaged.requires_grad_(False)
        self.averaged.eval()
        if self._pending is not None:  # state restored from a checkpoint before the model was known
            self.averaged.load_state_dict(self._pending.pop("averaged"))
            self.updates = int(self._pending["updates"])
            self._pending = None
        return self

    @torch.no_grad()
    def update(self, model: nn.Module | None = None) -> None:
        """One EMA step from `model` (default: the attached one)."""
        if self.averaged is None:
            raise RuntimeError("EMA.update() before attach(model): call ema.attach(model) first")
        if self.warmup and self.updates:  # (the first update copies the weights whatever the decay)
            self.averaged.multi_avg_fn = get_ema_multi_avg_fn(self.current_decay())
        self.averaged.update_parameters(model if model is not None else self.model)
        self.updates += 1

    def current_decay(self) -> float:
        """The decay the next update uses."""
        t = self.updates
        return min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay

    @property
    def module(self) -> nn.Module:
        """The averaged model, ready to evaluate (a plain `nn.Module` of the model's class)."""
        if self.averaged is None:
            raise RuntimeError("EMA.module before attach(model): call ema.attach(model) first")
        return self.averaged.module

    def copy_to(self, model: nn.Module | None = None) -> None:
        """Copy the EMA weights and buffers into `model` (default: the attached one)."""
        (model if model is not None else self.model).load_state_dict(self.module.state_dict())

    def state_dict(self) -> dict:
        if self.averaged is None:
            return dict(self._pending) if self._pending else {}
        return {"decay": self.decay, "warmup": self.warmup, "buffers": self.buffers, "updates": self.updates,
                "averaged": self.averaged.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        mine = {"decay": self.decay, "warmup": self.warmup, "buffers": self.buffers}
        if any(state.get(k) != v for k, v in mine.items()):
            log.warning("EMA: the checkpoint's EMA had %s; continuing with %s",
                        {k: state.get(k) for k in mine}, mine)
        if self.averaged is None:
            self._pending = dict(state)
        else:
            self.averaged.load_state_dict(state["averaged"])
            self.updates = int(state["updates"])

    # ------------------------------------------------------------------ as a trainer callback
    def on_train_start(self, trainer) -> None:
        if self.model is not trainer.module:  # not attached yet (or to another model): average the trained one
            self.attach(trainer.module)

    def on_step_end(self, trainer) -> None:
        self.update()

    def eval_module(self, module: nn.Module) -> nn.Module:
        return self.module if self.averaged is not None and module is self.model else module

    def best_state(self, state: dict) -> dict:
        if self.averaged is None:
            return state
        return {**state, "model": self.module.state_dict(), "train_model": state["model"]}

    def on_train_end(self, trainer, status: str) -> None:
        if self.apply_at_end and status == "success" and self.averaged is not None and self.updates:
            self.copy_to()

