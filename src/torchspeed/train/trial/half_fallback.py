"""A half precision the run did not ask for gives way to fp32 when its gradients break (T21's guard, extended).

The switch trial (or the rules) may put a run in bf16 because its steps measured faster. A model whose backward
overflows in bf16 (timm's `lambda_resnet26t` under Schedule-Free AdamW, on a 2-core EPYC: a finite loss at its
fifth step, non-finite gradients, every weight of its lambda layers NaN after the update, the 7 steps after it
skipped, a NaN model at the end) is then ruined by a choice the user never made. The NaN guard reads the loss; the
gradients broke first. So while a run trains in a half precision it was not asked for (`precision="auto"`) on the
CPU, with no GradScaler and the switch trial settled, the guard checks the gradients before each optimizer step:
one `torch._foreach_norm` over them, read on the host (free there). Non-finite gradients skip the step (as a NaN
loss does) and the run goes on in fp32 from the next step, the `precision` decision saying why. Where the switch
trial's choice is cached (its own or a hit), the entry is rewritten to fp32 with the reason, so the next run of
this model, input and machine starts in fp32 instead of losing a step to the same break. A precision the
user asked for (`precision="bf16"`) is theirs: its steps are skipped by the loss check alone, as before. On CUDA,
reading the flag each step would be a sync (T13): not checked there.

Example:
    >>> if watched(trainer):
    ...     trainer.guard.watch_half(lambda: half_unasked(trainer), lambda: fall_back_to_fp32(trainer))
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch

from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.parallel.distributed import is_rank_zero
from torchspeed.train.trial.precision import normalize_precision

__all__ = ["grads_nonfinite", "watched", "half_unasked", "fall_back_to_fp32"]

log = logging.getLogger("torchspeed")

_HALF = ("bf16", "fp16")


def grads_nonfinite(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any dense gradient the optimizer would apply holds a NaN or inf (one foreach norm, read on the host)."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None and not p.grad.is_sparse]
    return bool(grads) and not math.isfinite(float(torch.stack(torch._foreach_norm(grads)).sum()))


def watched(trainer) -> bool:
    """Whether the run's precision is the CPU run's to choose (`precision="auto"`: a precision asked for by any of
    its names, "bf16-mixed" too, is the user's): the guard watches its gradients then (`half_unasked`)."""
    return trainer.device.type == "cpu" and normalize_precision(trainer.config.precision) == "auto"


def half_unasked(trainer) -> bool:
    """A watched run trains in bf16 (or unscaled fp16) now, the switch trial settled (asked each optimizer step)."""
    return trainer.precision.name in _HALF and trainer.precision.scaler is None and trainer.switcher.live is None


def fall_back_to_fp32(trainer) -> None:
    """The run goes on in fp32 from the next step, switched as the trial switches (`SwitchStage.apply`: what a
    trained half-precision turn left in the step's state is cast back); the `precision` decision says why."""
    was, stage = trainer.precision.name, trainer.switcher
    cause = f"{was} (chosen, not asked for) gave non-finite gradients at step {trainer.step + 1} (that step skipped)"
    why = f"{cause}: the run goes on in fp32"
    stage.apply(replace(stage.current(), precision="fp32"))
    trainer.decisions.refine("precision", Decision("fp32", why))
    log.warning("torchspeed: %s", why)
    _cache_fp32(getattr(stage, "_trial_meta", {}).get("key"), cause)  # the trial's entry: its own, or the hit's


def _cache_fp32(key: str | None, cause: str) -> None:
    """The cached switch trial at `key` (if any) chooses fp32 from now on, and its summary says why."""
    if not key or not is_rank_zero():
        return
    cache = TrialCache()
    hit = cache.get(key)
    if not hit or "switches" not in hit:
        return
    stages = [s for s in hit.get("stages", []) if s.get("stage") != "fallback"]
    cache.put(key, hit | {"switches": {**hit["switches"], "precision": "fp32"}, "half_broke": cause,
                          "stages": stages + [{"stage": "fallback", "chosen": "fp32", "why": f"an earlier run's {cause}"}]})
