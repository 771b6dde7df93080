"""`input-not-normalized`: inputs far from zero mean / unit variance (T30)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding


@register("input-not-normalized", priority=180, techniques=("T30",), summary="model inputs are not normalized",
          per_step=False)
def check(obs: Observation):
    x = obs.get("model", {}).get("input")
    if not x:
        return None
    dtype = x["dtype"]
    if not (dtype.startswith("torch.float") or dtype.startswith("torch.bfloat") or dtype == "torch.uint8"):
        return None  # token ids and other integer inputs are not normalized by design
    fix = ("normalize: x = (x - mean) / std per channel (torchvision.transforms.Normalize, or once on the "
           "dataset); BatchNorm after the first layer helps too. Training then converges in fewer steps (T30)")
    stats = f"mean {x['mean']:.2f}, std {x['std']:.2f}, range [{x['min']:.2f}, {x['max']:.2f}], {dtype}"
    if dtype == "torch.uint8" or abs(x["mean"]) > 3 or x["std"] > 10 or max(abs(x["min"]), abs(x["max"])) > 50:
        return finding("input-not-normalized", evidence=f"the model's input has {stats}", fix=fix, est_gain=None,
                       obs=obs, severity="medium")
    if x["min"] >= 0 and x["max"] <= 1.0 and x["mean"] > 0.25:
        return finding("input-not-normalized", evidence=f"the model's input is in [0, 1] and not centred: {stats}",
                       fix=fix, est_gain=None, obs=obs, severity="low")
    return None
