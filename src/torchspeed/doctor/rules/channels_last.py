"""`channels-last`: a conv net in NCHW layout (T23)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import amdahl, finding, frac, on_cuda


@register("channels-last", priority=80, techniques=("T23",), summary="2D convolutions on NCHW tensors", fix="channels_last")
def check(obs: Observation):
    m = obs.get("model", {})
    if not m.get("has_conv2d") or m.get("channels_last_weights"):
        return None
    if on_cuda(obs):
        s = 1.25 if m.get("autocast") else 1.05
    else:
        s = 1.1  # oneDNN's NHWC kernels; measured per model with --verify
    est = amdahl(frac(obs, "compute"), s)
    evidence = "the model has Conv2d layers and runs them in NCHW (contiguous) layout"
    fix = ("model = torchspeed.apply_channels_last(model) (= model.to(memory_format=torch.channels_last)) and "
           "x = x.contiguous(memory_format=torch.channels_last) for each batch (T23)")
    return finding("channels-last", evidence=evidence, fix=fix, est_gain=est, obs=obs, verify_fix="channels_last",
                   patch="channels_last")
