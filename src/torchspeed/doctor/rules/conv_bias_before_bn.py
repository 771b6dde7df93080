"""`conv-bias-before-bn`: a conv bias that the following BatchNorm cancels (T27)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding

EST = 1.02  # one broadcast add and one optimizer update per conv; --verify measures it


@register("conv-bias-before-bn", priority=120, techniques=("T27",), summary="Conv(bias=True) directly followed by BatchNorm", fix="conv_bias",
          per_step=False)
def check(obs: Observation):
    pairs = obs.get("model", {}).get("conv_bias_before_bn") or []
    if not pairs:
        return None
    shown = ", ".join(pairs[:4]) + (f" (+{len(pairs) - 4} more)" if len(pairs) > 4 else "")
    evidence = f"{len(pairs)} convolutions with a bias feed straight into BatchNorm: {shown}"
    fix = ("Conv2d(..., bias=False) before BatchNorm, or torchspeed.remove_conv_bias(model, example_input=x) "
           "(exact: folds the bias into the running mean) (T27)")
    return finding("conv-bias-before-bn", evidence=evidence, fix=fix, est_gain=EST, obs=obs, verify_fix="conv_bias")
