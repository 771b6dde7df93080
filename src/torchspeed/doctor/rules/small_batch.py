"""`small-batch`: per-step overhead dominates a tiny batch (T17)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, on_cuda


@register("small-batch", priority=160, techniques=("T17",), summary="a batch too small to keep the device busy")
def check(obs: Observation):
    bs = obs.get("model", {}).get("batch_size")
    if not bs:
        return None
    limit_med, limit_low = (16, 32) if on_cuda(obs) else (8, 16)
    if bs >= limit_low:
        return None
    b = obs.get("breakdown", {})
    per = b.get("step_ms", 0.0) / bs
    evidence = f"batch size {bs}: {per:.2f} ms per sample, with the fixed cost of a step (launches, optimizer, Python) paid for every {bs} samples"
    fix = ("raise the batch to the largest that fits (`torchspeed tune` finds it) and scale the learning rate "
           "with it (torchspeed.scale_lr); use gradient accumulation only for the optimisation side (T17, T19)")
    return finding("small-batch", evidence=evidence, fix=fix, est_gain=None, obs=obs,
                   severity="medium" if bs < limit_med else "low")
