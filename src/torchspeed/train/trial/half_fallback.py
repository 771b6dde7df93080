"""A half precision the run did not ask for gives way to fp32 when its gradients break (T21's guard, extended).

The switch trial (or the rules) may put a run in bf16 because its steps measured faster. A model whose backward
overflows in bf16 (timm's `lambda_resnet26t` under Schedule-Free AdamW, on a 2-core EPYC: a finite loss at its
fifth step, non-finite gradients, every weight of its lambda layers NaN after the update, the 7 steps after it
skipped, a NaN model at the end) is then ruined by a choice the user never made. The NaN guard reads the loss; the
gradients broke first. So while a run trains in a half precision it was not asked for (`precision="auto"`) on the
CPU, with no GradScaler and the switch trial settled, the guard checks the gradients before each optimizer step:
one `torch._foreach_norm` over them, read on the host (free there). Non-finite gradients skip the step (as a NaN
loss does) and the run goes on in fp32 from the next step, the `precision` decision saying why. A precision the
user asked for (`precision="bf16"`) is theirs: its steps are skipped by the loss check alone, as before. On CUDA,
reading the flag each step would be a sync (T13): not checked there.

Example:
    >>> trainer.guard.watch_half(lambda: half_unasked(trainer), lambda: fall_back_to_fp32(trainer))
"""

from __future__ import annotations

import logging
import math

import torch

from torchspeed.train.decision import Decision
from torchspeed.train.trial.precision import MixedPrecision, Precision, normalize_precision

__all__ = ["grads_nonfinite", "half_unasked", "fall_back_to_fp32"]

log = logging.getLogger("torchspeed")

_HALF = ("bf16", "fp16")


def grads_nonfinite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any dense gradient the optimizer would apply holds a NaN or inf (one foreach norm, read on the host)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None and not p.grad.is_sparse]
    return bool(grads) and not math.isfinite(float(torch.stack(torch._foreach_norm(grads)).sum()))


def half_unasked(trainer) -> bool:
    """The run trains in bf16 (or unscaled fp16) that `precision="auto"` chose, on the CPU, the switch trial settled
    (a precision asked for by any of its names, "bf16-mixed" too, is the user's)."""
    return (trainer.device.type == "cpu" and trainer.precision.name in _HALF and trainer.precision.scaler is None
            and normalize_precision(trainer.config.precision) == "auto" and trainer.switcher.live is None)


def fall_back_to_fp32(trainer) -> None:
    """The run goes on in fp32 from the next step; the `precision` decision says why."""
    was = trainer.precision.name
    why = (f"{was} (chosen, not asked for) gave non-finite gradients at step {trainer.step + 1} (that step skipped): "
           "the run goes on in fp32")
    trainer.precision = MixedPrecision(Precision("fp32", trainer.device.type, why))
    trainer.decisions.refine("precision", Decision("fp32", why))
    log.warning("torchspeed: %s", why)
