"""Validation under `torch.inference_mode()` (T28) with optional test-time augmentation (T33).

inference_mode records no autograd graph and skips version-counter bookkeeping: less memory
and less work than `no_grad`. TTA averages the softmax over views of each image:
`tta="flip"` adds the horizontal mirror; `tta_scales=(0.875, 1.0, 1.125)` adds resized copies
(multi-scale). Both cost one extra forward per view.

`EvalClock` prices validation inside a run: when it is due (every epoch, or `eval_every` N steps or
S seconds of training, and always at the end; N steps under an epoch evaluate inside the epoch every N steps,
and at each epoch end; S seconds evaluate inside an epoch that runs longer than S, every S seconds of
training), the seconds it took, and its share of the run. A run
whose evaluations took more than `EVAL_SHARE_WARN` (5%) of its time, and a second or more in all, says
so, with the `eval_every` that would bring them to about 2%.

Example:
    >>> evaluate(model, val_loader, device=device, precision=p, tta="flip")
    {'val_loss': 0.41, 'val_acc': 0.88, 'samples': 10000}
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.train.loop.batch import StepOutput, forward_loss
from torchspeed.train.losses import default_loss
from torchspeed.train.decision import Decision
from torchspeed.train.loop.metrics import DeviceMeter
from torchspeed.train.trial.precision import Precision, resolve_precision
from torchspeed.train.transfer import to_device

__all__ = ["averaged_log_probs", "evaluate", "is_image_batch", "tta_views", "EvalClock", "EVAL_SHARE_WARN"]

log = logging.getLogger("torchspeed")

EVAL_SHARE_WARN = 0.05  # a run whose evaluations take more of its time than this says so
EVAL_SHARE_AIM = 0.02   # the share the suggested eval_every aims at
EVAL_WARN_MIN_S = 1.0   # evaluations that took less than this in all are not worth a warning


class EvalClock:
    """When validation is due, and what it cost: `every` is `parse_eval_every`'s ("steps", N) / ("seconds", S),
    or None for every epoch. `clock` is injectable (tests)."""

    def __init__(self, every: tuple[str, float] | None, *, step: int = 0,
                 clock: Callable[[], float] = time.perf_counter, steps_per_epoch: int | None = None):
        self.every, self.clock = every, clock
        self.t0 = self.mark_t = clock()
        self.mark_step = step
        self.count, self.seconds = 0, 0.0
        kind, n = every or ("epoch", 0.0)
        # eval_every=N steps under an epoch: every N optimizer steps inside the epoch, and at each epoch end
        self.mid = int(n) if kind == "steps" and steps_per_epoch and n < steps_per_epoch else None
        # eval_every="S" seconds: inside an epoch once S seconds of training passed since the last validation and
        # since the epoch began (an epoch shorter than S evaluates at its end, as before)
        self.mid_s = float(n) if kind == "seconds" else None
        self.epoch_t = self.t0

    @property
    def inside(self) -> bool:
        """Whether validations can fall inside an epoch (eval_every N steps under an epoch, or S seconds)."""
        return self.mid is not None or self.mid_s is not None

    def start_epoch(self) -> bool:
        """An epoch begins (its clock starts); returns `inside`."""
        self.epoch_t = self.clock()
        return self.inside

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether the epoch that ended at optimizer step `step` evaluates (`last`: the run's final epoch always)."""
        kind, n = self.every or ("epoch", 0.0)
        due = (last or kind == "epoch" or self.mid is not None or (kind == "steps" and step - self.mark_step >= n)
               or (kind == "seconds" and self.clock() - self.mark_t >= n))  # training seconds since the last one
        if due:
            self.mark_step = step
        return due

    def due_mid(self, step: int) -> bool:
        """Whether optimizer step `step`, inside an epoch, evaluates: N steps since the last validation (one int
        compare a step), or S seconds of training since it and since the epoch began (one clock read a step)."""
        if self.mid is not None:
            due = step - self.mark_step >= self.mid
        elif self.mid_s is not None:
            now = self.clock()
            due = now - max(self.mark_t, self.epoch_t) >= self.mid_s
            if due:
                self.mark_t = now  # and again when the validation ends (`timing`)
        else:
            return False
        if due:
            self.mark_step = step
        return due

    @contextlib.contextmanager
    def timing(self):
        """Around one evaluation: its seconds are counted, and the next interval starts when it ends."""
        t = self.clock()
        try:
            yield
        finally:
            self.mark_t = self.clock()
            self.seconds += self.mark_t - t
            self.count += 1

    def record(self, decisions, every, *, steps: int) -> None:
        """decisions["evaluation"] = `decision(...)` when the run evaluated (a second fit of one trainer refines it)."""
        if self.count:
            decisions.refine("evaluation", self.decision(every, steps=steps))

    def decision(self, every, *, steps: int) -> Decision:
        """The evaluations' share of the run as a Decision; over `EVAL_SHARE_WARN` it also warns, with advice."""
        total = self.clock() - self.t0
        share = self.seconds / max(total, 1e-9)
        why = (f"{self.count} evaluations took {self.seconds:.2f} s of the {total:.1f} s training loop "
               f"({'every epoch' if every is None else f'eval_every={every!r}'})")
        advice = self.advice(steps=steps, total_s=total)
        if share > EVAL_SHARE_WARN and advice and self.seconds >= EVAL_WARN_MIN_S:
            log.warning("torchspeed: evaluation took %.0f%% of the run (%d evaluations, %.1f s); %s", 100 * share,
                        self.count, self.seconds, advice)
            why += f"; {advice}"
        return Decision(round(share, 4), why, measured={"seconds": round(self.seconds, 4), "count": self.count,
                                                        "run_s": round(total, 4)})

    def advice(self, *, steps: int, total_s: float) -> str | None:
        """The eval_every (in steps) that brings evaluation to about `EVAL_SHARE_AIM` of the run, if it is rarer
        than every epoch; None when evaluating is already cheap enough or there is nothing to space out."""
        if self.count < 3 or steps < 2:
            return None
        per_eval = self.seconds / self.count
        wanted = max(1, math.floor(EVAL_SHARE_AIM * total_s / per_eval))
        if wanted >= self.count:
            return None
        n = math.ceil(steps / wanted)
        times = "once, at the end" if wanted == 1 else f"{wanted} times"
        return f"eval_every={n} (steps) would evaluate {times} instead of {self.count} times"


def is_image_batch(batch) -> bool:
    """(images, labels) with images (N, C, H, W): the batches test-time augmentation applies to."""
    return (isinstance(batch, (list, tuple)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor)
            and batch[0].dim() == 4 and isinstance(batch[1], torch.Tensor))


def averaged_log_probs(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The log of the mean softmax over the views' logits: TTA's prediction (one view: the plain log-softmax)."""
    probs = torch.stack([F.softmax(o.float(), dim=-1) for o in outputs]).mean(0)
    return probs.clamp_min(1e-12).log()


def tta_views(x: torch.Tensor, *, flip: bool = False, scales: Sequence[float] = ()) -> list[torch.Tensor]:
    """The inputs to average over: the original, its mirror, and rescaled copies."""
    views = [x]
    if flip:
        views.append(torch.flip(x, dims=[-1]))
    h, w = x.shape[-2:]
    for s in scales:
        if s == 1.0:
            continue
        size = (max(1, round(h * s)), max(1, round(w * s)))
        views.append(F.interpolate(x, size=size, mode="bilinear", align_corners=False))
    return views


def evaluate(model: nn.Module, loader: Iterable, *, device: torch.device | str | None = None,
             precision: Precision | str = "fp32", loss_fn: Callable | None = None, step_fn: Callable | None = None,
             channels_last: bool = False, tta: str | None = None,
             tta_scales: Sequence[float] = ()) -> dict[str, float | None]:
    """Mean loss, and top-1 accuracy where the task is classification, of `model` over `loader`.

    Batches follow the contract in `torchspeed.train.loop.batch` (tuples, dicts, models returning
    their loss, `step_fn`). A model that takes its target is called with it, so `val_loss` is
    its own loss over every position (not the last-position shortcut some models take without
    targets); a model returning a dict of losses also gets `val_<name>` per loss. `val_acc` is
    None for regression and loss-only models; per token for sequence models, per pixel for masks.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if isinstance(precision, str):
        precision = resolve_precision(precision, device=device)
    loss_fn = loss_fn or default_loss()
    if tta not in (None, "flip"):
        raise ValueError(f"tta={tta!r}: use None or 'flip' (and tta_scales for multi-scale)")
    meter = DeviceMeter(device)
    parts: dict[str, DeviceMeter] = {}  # the named losses of a model that returns several (val_<name>)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in loader:
                batch = to_device(batch, device, channels_last=channels_last)
                with precision.autocast():
                    if (tta == "flip" or tta_scales) and step_fn is None:
                        out = _tta_forward(model, batch, flip=tta == "flip", scales=tta_scales)
                    else:
                        out = forward_loss(model, batch, loss_fn=loss_fn, step_fn=step_fn)
                correct = out.correct()
                meter.update(out.loss.float(), n=out.n, correct=None if correct is None else correct[0],
                             counted=None if correct is None else correct[1])
                for name, value in (out.parts or {}).items():
                    parts.setdefault(name, DeviceMeter(device)).update(value.float(), n=out.n)
    finally:
        model.train(was_training)
    m = meter.compute()
    return {"val_loss": m["loss"], "val_acc": m["acc"], "samples": m["samples"],
            **{f"val_{name}": pm.compute()["loss"] for name, pm in parts.items()}}


def _tta_forward(model: nn.Module, batch, *, flip: bool, scales: Sequence[float]) -> StepOutput:
    """Average the softmax over the views of an image batch `(x, y)`."""
    if not is_image_batch(batch):
        raise ValueError("test-time augmentation (tta/tta_scales) needs (images, labels) batches with images "
                         "of shape (N, C, H, W)")
    x, y = batch
    logits = averaged_log_probs([model(v) for v in tta_views(x, flip=flip, scales=scales)])
    return StepOutput(F.nll_loss(logits, y), logits, y, int(y.shape[0]))
