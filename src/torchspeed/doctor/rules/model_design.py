"""`model-design`: grouped / depthwise convolutions that cost far more time than their FLOPs (T36)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding

TIME_SHARE = 0.10   # of the forward time
INEFFICIENCY = 1.5  # time share / FLOPs share: how much worse per FLOP than the rest of the model


@register("model-design", priority=170, techniques=("T36",), summary="memory-bound grouped/depthwise convolutions",
          per_step=False)
def check(obs: Observation):
    d = obs.get("model", {}).get("design") or {}
    if not d.get("grouped_convs"):
        return None
    ts, fs = d["grouped_time_share"], d["grouped_flops_share"]
    if ts < TIME_SHARE or ts < INEFFICIENCY * fs:
        return None
    evidence = (f"{d['grouped_convs']} grouped/depthwise convolutions do {fs:.0%} of the forward FLOPs but take "
                f"{ts:.0%} of its time here ({ts / max(fs, 1e-9):.1f}x the time per FLOP of the rest): they are "
                "memory-bound")
    fix = ("on CPU run depthwise convs in channels_last (oneDNN's NCHW depthwise kernels are far slower per "
           "FLOP); otherwise follow the ShuffleNetV2 guidelines: fewer groups, equal in/out channels, fewer branches and element-wise ops; "
           "measure wall time, not FLOPs, when choosing a design (T36)")
    return finding("model-design", evidence=evidence, fix=fix, est_gain=None, obs=obs,
                   severity="medium" if ts >= 0.3 and ts >= 3 * fs else "low")
