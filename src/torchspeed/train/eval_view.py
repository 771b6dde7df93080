"""The weights a trained model is judged by (T40, T14's Schedule-Free alternative): the EMA's when an EMA callback is
on, a Schedule-Free optimizer's averaged weights, with BatchNorm statistics recomputed for them, otherwise the
training weights. `Trainer.evaluate` and the recipe's after-training TTA check both look through `eval_weights`,
so the check scores the model that is evaluated and saved. `settle_averaged` leaves a Schedule-Free run's model
holding those averaged weights at the end of `fit` (the best epoch's, with `restore_best`): the model you get back
is the one that was evaluated and saved, not the optimizer's training iterate. Their BatchNorm statistics are
recomputed there only when a step came after the last evaluation (which computed them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from torchspeed.train.loop.batch import batch_size
from torchspeed.train.bnstats import recalibrate_bn
from torchspeed.train.optim import SCHEDULE_FREE_BN_SAMPLES, averaged_weights, eval_mode
from torchspeed.train.trial.user_state import UserState

log = logging.getLogger("torchspeed")

__all__ = ["eval_weights", "newest_samples", "recalibrate_averaged", "settle_averaged"]


def newest_samples(batches, samples: int) -> list:
    """The newest of `batches` (oldest first) that together hold at least `samples` samples (all of them when they
    hold fewer), oldest first."""
    out, n = [], 0
    for b in reversed(list(batches)):
        out.append(b)
        n += batch_size(b)
        if n >= samples:
            break
    return out[::-1]


def recalibrate_averaged(module: nn.Module, recent, precision, *, device, step_fn=None,
                         channels_last: bool = False) -> int:
    """BatchNorm statistics for a Schedule-Free optimizer's averaged weights: recomputed on the newest of the
    `recent` training batches that hold SCHEDULE_FREE_BN_SAMPLES samples, in the run's `precision` (the statistics
    of the forward passes the model was trained with). Returns the batches used."""
    with precision.autocast():
        return recalibrate_bn(module, newest_samples(recent, SCHEDULE_FREE_BN_SAMPLES), device=device,
                              step_fn=step_fn, channels_last=channels_last)


@contextmanager
def eval_weights(trainer) -> Iterator[nn.Module]:
    """Inside the block: the module to evaluate (see the module docstring); the training weights again after."""
    module = trainer.callbacks.eval_module(trainer.module)  # the EMA weights when an EMA callback is on
    with averaged_weights(trainer.optimizer) as switched:  # Schedule-Free: its averaged weights, their BN statistics
        if switched:  # else the end of a fit (`settle_averaged`) recalibrated them, and nothing trained since
            _recalibrate(trainer, module)
        yield module


def _recalibrate(trainer, module: nn.Module) -> None:
    """BatchNorm statistics for the averaged weights `module` holds, on the trainer's newest training batches (kept
    only for a Schedule-Free run of a model with BatchNorm)."""
    recent = getattr(trainer, "_recent", None)
    if recent:
        state = UserState(module, trainer.step_fn).snapshot()  # passes that only measure: the step_fn's state stays
        try:
            recalibrate_averaged(module, recent, trainer.precision, device=trainer.device, step_fn=trainer.step_fn,
                                 channels_last=trainer.channels_last)
        except Exception as e:  # noqa: BLE001 - a step_fn that cannot run without gradients (it steps a GAN's D)
            if trainer.step_fn is None:
                raise
            log.warning("torchspeed: BatchNorm statistics for Schedule-Free's averaged weights kept from training: "
                        "the step_fn cannot run as a forward pass without gradients (%s: %s)", type(e).__name__, e)
        finally:
            state.restore()
        if module is trainer.module:  # (not an EMA's copy) its statistics hold for the averaged weights until a step
            trainer._bn_for_step = trainer.step


def settle_averaged(trainer) -> None:
    """The end of a fit: a Schedule-Free optimizer switched to its averaged weights for good (`optimizer.eval()`),
    BatchNorm statistics recomputed for them as an evaluation does. The model then holds what was evaluated and
    saved; a later fit's first epoch switches back (`optimizer.train()`), and a checkpoint saves these weights."""
    if eval_mode(trainer.optimizer):
        if getattr(trainer, "_bn_for_step", None) != trainer.step:  # else an evaluation at this step recalibrated them
            _recalibrate(trainer, trainer.module)
