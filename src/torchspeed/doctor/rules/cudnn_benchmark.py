"""`cudnn-benchmark`: cuDNN picks convolution algorithms by heuristic, not by timing (T22)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import amdahl, finding, frac, on_cuda


@register("cudnn-benchmark", priority=90, techniques=("T22",), summary="torch.backends.cudnn.benchmark is off for a conv net")
def check(obs: Observation):
    m = obs.get("model", {})
    if not on_cuda(obs) or not m.get("has_conv2d") or obs.get("cudnn_benchmark"):
        return None
    evidence = "the model runs Conv2d on CUDA with torch.backends.cudnn.benchmark=False"
    fix = "torch.backends.cudnn.benchmark = True when input shapes are fixed (torchspeed.configure_backends) (T22)"
    return finding("cudnn-benchmark", evidence=evidence, fix=fix, est_gain=amdahl(frac(obs, "compute"), 1.1), obs=obs,
                   patch="cudnn")
